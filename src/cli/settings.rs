//! `ragen-lab settings`: every training setting with its default and meaning, read from the one
//! declaration in `starpo::settings`.
use crate::starpo::settings::{Preset, Settings};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Show the values of this preset instead of the defaults (starpo-s is the default preset).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Print the resolved settings as JSON (the form `settings.json` and `--set` use).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let settings = Settings::preset(args.preset.unwrap_or(Preset::StarpoS));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&settings)?);
        return Ok(());
    }
    let values = serde_json::to_value(&settings)?;
    println!("Training settings (override with --set key=value, or a `settings` map in the experiment script).");
    let mut section = String::new();
    for (key, _, doc) in Settings::describe() {
        let (sec, field) = key.split_once('.').expect("dotted key");
        if sec != section {
            println!("\n[{sec}]");
            section = sec.to_string();
        }
        println!("  {key} = {}\n      {doc}", values[sec][field]);
    }
    Ok(())
}

//! `ragen-lab model …` (being built).

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Architecture, parameter count, dtype, context length, chat template, special tokens.
    Info {},
}

pub fn run(_cmd: Command) -> anyhow::Result<()> {
    anyhow::bail!("`ragen-lab model` is not built yet")
}

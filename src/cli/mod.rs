//! The command line: one file per subcommand, each a clap `Args` struct and a `run` that calls
//! the library and prints. No algorithm lives here.
use clap::{Parser, Subcommand};

pub mod bench;
pub mod check;
pub mod eval;
pub mod model;
pub mod new;
pub mod play;
pub mod plot;
pub mod serve;
pub mod settings;
pub mod sft;
pub mod train;
pub mod view;

/// Train LLM agents with multi-turn reinforcement learning (StarPO / StarPO-S, after RAGEN).
///
/// Environments, prompt templates and reward shaping are Rhai scripts (envs/, prompts/,
/// rewards/); an experiment script in scripts/ ties them together with the run's settings.
#[derive(Parser, Debug)]
#[command(name = "ragen-lab", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a policy with StarPO-S (default) or StarPO on an experiment script.
    Train(train::Args),
    /// Warm-start a model before RL: fine-tune it on the env solver's demonstrations.
    Sft(sft::Args),
    /// Evaluate a model served over HTTP (OpenAI-compatible) on an experiment's validation episodes.
    Eval(eval::Args),
    /// Serve a model, checkpoint or LoRA adapter over an OpenAI-compatible HTTP API.
    Serve(serve::Args),
    /// Play an environment script by hand or with a list of actions.
    Play(play::Args),
    /// Check a script: compile, contract, random episodes under the limits, determinism.
    Check(check::Args),
    /// Write a commented starter environment and experiment script.
    New(new::Args),
    /// Inspect, chat with, score with, or fetch a model.
    #[command(subcommand)]
    Model(model::Command),
    /// Print every training setting with its default and meaning.
    Settings(settings::Args),
    /// Measure speed: env steps/s through the script host, model tokens/s.
    Bench(bench::Args),
    /// Draw a run's metrics (PNG and SVG), several runs on one chart.
    Plot(plot::Args),
    /// The dashboard of a run: an offline page, or served live (--serve) while it trains.
    View(view::Args),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::Sft(a) => sft::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Play(a) => play::run(a),
        Command::Check(a) => check::run(a),
        Command::New(a) => new::run(a),
        Command::Model(c) => model::run(c),
        Command::Settings(a) => settings::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Plot(a) => plot::run(a),
        Command::View(a) => view::run(a),
    }
}

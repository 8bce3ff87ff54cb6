//! `ragen-lab view`: build the offline dashboard of a run, and optionally serve the live one.
use crate::metrics::run::check_dir;
use crate::metrics::tensorboard;
use crate::view;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "The dashboard of a run: its health (step, steps/min, ETA, last alarm), the metric curves with Echo-Trap alarms and script swaps marked, each step's reward histogram, groups side by side and trajectories as dialogue turns (filters by group, success and validity), a steps table, alarms and events, and the script versions with their diffs. Written as one HTML file that opens offline (the newest steps' trajectories embedded); with --serve, live: new steps, alarms and events arrive as they are written, and rollouts load a page at a time."
)]
pub struct Args {
    /// The run directory (runs/<name>/).
    #[arg(value_name = "RUN")]
    pub run: PathBuf,
    /// Where to write the offline page [default: RUN/view/index.html].
    #[arg(long, value_name = "FILE", conflicts_with = "serve")]
    pub out: Option<PathBuf>,
    /// Serve the live dashboard on http://127.0.0.1:PORT (0 = any free port) instead of writing
    /// the offline page: it follows a run that is still training, without reloading, and reads
    /// rollouts a page at a time. It only reads the run directory. Requests must
    /// name the server as localhost or by IP address (Host header), which shuts out
    /// DNS-rebinding pages.
    #[arg(long, value_name = "PORT")]
    pub serve: Option<u16>,
    /// With --serve: the address to listen on, e.g. 0.0.0.0 to let other machines in (anyone who
    /// can reach it can read the run).
    #[arg(long, value_name = "IP", default_value = "127.0.0.1", requires = "serve")]
    pub bind: std::net::IpAddr,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    check_dir(&args.run)?;
    if let Some(p) = tensorboard::ensure_tb(&args.run)? {
        println!("wrote {} (TensorBoard, from metrics.jsonl)", p.display());
    }
    let Some(port) = args.serve else {
        let page = view::build(&args.run, args.out.as_deref())?;
        println!("wrote {}", page.display());
        return Ok(());
    };
    // The live page reads everything from the server: no offline copy to write (on a long run it
    // would cost the start the time to read its newest steps' trajectories).
    view::serve::serve(&args.run, args.bind, port, |addr| {
        println!("serving {} on http://{addr}/ (ctrl-c to stop)", args.run.display());
    })
}

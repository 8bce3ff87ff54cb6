use clap::Parser;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // Die quietly on a closed pipe (`ragen-lab settings | head`) like other Unix tools, instead
    // of panicking in println!.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = ragen_lab::cli::Cli::parse();
    if let Err(err) = ragen_lab::cli::run(cli) {
        eprintln!("ragen-lab: {err:#}");
        std::process::exit(2);
    }
}

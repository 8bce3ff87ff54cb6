use clap::Parser;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = ragen_lab::cli::Cli::parse();
    if let Err(err) = ragen_lab::cli::run(cli) {
        eprintln!("ragen-lab: {err:#}");
        std::process::exit(2);
    }
}

use clap::Parser;

// `Counted` tallies each thread's allocations so the script sandbox can enforce
// `Limits::max_memory` (src/script/memory.rs); it forwards every call unchanged.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: ragen_lab::script::Counted<mimalloc::MiMalloc> = ragen_lab::script::Counted(mimalloc::MiMalloc);
#[cfg(not(feature = "mimalloc"))]
#[global_allocator]
static GLOBAL: ragen_lab::script::Counted<std::alloc::System> = ragen_lab::script::Counted(std::alloc::System);

/// Keep freed memory for reuse instead of returning it to the OS. A training step frees and
/// re-allocates gigabytes of same-sized tensors; returned pages come back as fresh page faults
/// the kernel must zero, which took 65% of a step's CPU time (perf, notes/candle-cpu.md). The
/// peak footprint is unchanged; only its pages are recycled. `MIMALLOC_PURGE_DELAY` still wins.
#[cfg(feature = "mimalloc")]
fn keep_freed_memory() {
    // `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (libmimalloc-sys does not name it).
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an allocator option, before any thread other than main exists.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// Fix the thread counts once, before any other thread exists (so no one reads the environment
/// concurrently); a user's own settings win.
/// - `RAYON_NUM_THREADS` (matmuls): unset, candle re-derives it from /proc/cpuinfo on every
///   matmul (`num_cpus::get_physical`), several percent of a decode step.
/// - `CANDLE_NUM_THREADS` (element-wise ops): candle runs them on a second pool of as many
///   spinning threads, which fight the matmul threads for the same cores; on the calling thread
///   alone a Bandit step took 6.2 s instead of 7.2 s and a third of the system time (2 cores).
fn pin_thread_counts() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

fn main() {
    #[cfg(feature = "mimalloc")]
    keep_freed_memory();
    pin_thread_counts();
    // Die quietly on a closed pipe (`ragen-lab settings | head`) like other Unix tools, instead
    // of panicking in println!.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = ragen_lab::cli::Cli::parse();
    // Commands run scripts on this thread: give it the stack the script limits need (a bad
    // RAGEN_LIMITS is reported by the command itself).
    let limits = ragen_lab::script::Limits::from_env().unwrap_or_default();
    let command = limits.spawn("ragen-lab", move || ragen_lab::cli::run(cli)).expect("starting the command's thread");
    let result = command.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    if let Err(err) = result {
        eprintln!("ragen-lab: {err:#}");
        std::process::exit(2);
    }
}

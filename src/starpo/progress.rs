//! The terminal progress bar of the long jobs (train, eval, sft): one style for all of them,
//! drawn on stderr, hidden when the user asked for quiet.
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// `⠋ {what} 3/20 [00:01:02 < 00:05:10] {message}`, ticking on its own so a long step still moves.
pub fn progress_bar(show: bool, what: &str, total: u64) -> ProgressBar {
    let target = if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    let template = format!("{{spinner}} {what} {{pos}}/{{len}} [{{elapsed_precise}} < {{eta_precise}}] {{msg}}");
    bar.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

//! The run's numbers after the trainer has produced them: Echo-Trap diagnostics and alarms,
//! TensorBoard event files, reading a run directory back, and the plots; the metric keys they
//! all share are declared once in [`keys`].
pub mod collapse;
pub mod echo_trap;
pub mod keys;
pub mod plot;
pub mod png;
pub mod run;
pub mod tensorboard;

//! Live reload. A [`Watcher`] watches the folders of the scripts it was given (folders, not
//! files: editors save by writing a new file and renaming it over the old one, which kills a
//! watch on the file itself). On a change to any `*.rhai` there, a background thread compares the
//! content of each script and its imports with the last version it saw; a script that changed is
//! recompiled and smoke-tested under the limits ([`validate::load`]), off the caller's thread.
//! The caller takes the results with [`Watcher::poll`] at a boundary of its own (a training
//! step, a prompt): a good version to swap in, or the error (`path:line:col`) of a bad one, in
//! which case the caller simply keeps the version it has.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use notify_debouncer_full::notify::RecursiveMode;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::engine::Host;
use super::error::{ErrorKind, ScriptError};
use super::resolver::read_script;
use super::validate::{self, Loaded, Role};

/// How changes are noticed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchMode {
    /// OS file events (inotify, FSEvents, …), debounced by 200 ms.
    Events,
    /// Re-read the files every `interval` (for network drives, WSL, containers where events
    /// do not arrive).
    Poll(Duration),
}

/// The outcome of one noticed change.
#[derive(Debug)]
pub enum Update {
    /// A new version compiled and passed the smoke test: swap it in at your next boundary.
    Swapped { path: PathBuf, role: Role, loaded: Loaded },
    /// The new version failed; keep the one you have.
    Rejected { path: PathBuf, role: Role, error: ScriptError },
}

struct Entry {
    path: PathBuf,
    role: Role,
    params: Map<String, Value>,
    sources: Vec<PathBuf>,
    fingerprint: String,
}

/// Larger files are not scripts the host would compile; they fingerprint by their error.
const MAX_FINGERPRINT_BYTES: usize = 16 << 20;

fn fingerprint(files: &[PathBuf]) -> String {
    let mut h = Sha256::new();
    for f in files {
        h.update(f.to_string_lossy().as_bytes());
        // Never blocks (a FIFO put in a script's place) and never reads a huge file whole.
        match read_script(f, MAX_FINGERPRINT_BYTES) {
            Ok(text) => h.update(text.as_bytes()),
            Err(e) => h.update(e.as_bytes()),
        }
    }
    hex::encode(h.finalize())
}

/// Watches scripts and offers validated new versions; see the module docs.
pub struct Watcher {
    rx: Receiver<Update>,
    stop: Arc<AtomicBool>,
    tick: Sender<()>,
    worker: Option<JoinHandle<()>>,
    _events: Option<
        notify_debouncer_full::Debouncer<
            notify_debouncer_full::notify::RecommendedWatcher,
            notify_debouncer_full::RecommendedCache,
        >,
    >,
}

impl Watcher {
    /// Watches `scripts` (path, role, env parameters for the smoke test). Their current content
    /// is the baseline: only later changes are reported.
    pub fn new(
        host: Arc<Host>,
        scripts: Vec<(PathBuf, Role, Map<String, Value>)>,
        mode: WatchMode,
    ) -> anyhow::Result<Self> {
        let mut entries = Vec::new();
        for (path, role, params) in scripts {
            let path = host.resolve_path(&path);
            let path = path.canonicalize().unwrap_or(path);
            let sources = match validate::load(&host, &path, role, &params) {
                Ok(l) => validate::sources(&host, &l),
                Err(_) => vec![path.clone()],
            };
            let fingerprint = fingerprint(&sources);
            entries.push(Entry { path, role, params, sources, fingerprint });
        }
        let dirs: BTreeSet<PathBuf> =
            entries.iter().flat_map(|e| e.sources.iter().filter_map(|s| s.parent().map(Path::to_path_buf))).collect();
        let (tx, rx) = channel();
        let (tick, ticks) = channel::<()>();
        let stop = Arc::new(AtomicBool::new(false));
        let events = match mode {
            WatchMode::Events => {
                let t = tick.clone();
                let mut d = notify_debouncer_full::new_debouncer(
                    Duration::from_millis(200),
                    None,
                    move |res: notify_debouncer_full::DebounceEventResult| {
                        let touched = res
                            .map(|evs| {
                                evs.iter().any(|e| e.paths.iter().any(|p| p.extension().is_some_and(|x| x == "rhai")))
                            })
                            .unwrap_or(true);
                        if touched {
                            let _ = t.send(());
                        }
                    },
                )?;
                for dir in &dirs {
                    d.watch(dir, RecursiveMode::NonRecursive)
                        .map_err(|e| anyhow::anyhow!("cannot watch {}: {e} (try --poll)", dir.display()))?;
                }
                Some(d)
            }
            WatchMode::Poll(_) => None,
        };
        let interval = match mode {
            WatchMode::Poll(i) => Some(i),
            WatchMode::Events => None,
        };
        let stop2 = stop.clone();
        // Smoke tests run scripts here: give them the stack the limits need, not a worker's 2 MiB.
        let worker = host.limits().clone().spawn("script-watcher", move || {
            let mut entries = entries;
            while !stop2.load(Ordering::Relaxed) {
                let got = match interval {
                    Some(i) => match ticks.recv_timeout(i) {
                        Ok(()) | Err(RecvTimeoutError::Timeout) => true,
                        Err(RecvTimeoutError::Disconnected) => false,
                    },
                    None => ticks.recv().is_ok(),
                };
                if !got || stop2.load(Ordering::Relaxed) {
                    break;
                }
                while ticks.try_recv().is_ok() {}
                for e in entries.iter_mut() {
                    if let Some(u) = recheck(&host, e) {
                        if tx.send(u).is_err() {
                            return;
                        }
                    }
                }
            }
        })?;
        Ok(Self { rx, stop, tick, worker: Some(worker), _events: events })
    }

    /// The updates ready now (never blocks). Call it at a boundary.
    pub fn poll(&self) -> Vec<Update> {
        self.rx.try_iter().collect()
    }

    /// Waits up to `timeout` for the next update (for interactive tools and tests).
    pub fn wait(&self, timeout: Duration) -> Option<Update> {
        self.rx.recv_timeout(timeout).ok()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self._events.take();
        let _ = self.tick.send(());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Recompiles `e` when its files changed since the last look.
fn recheck(host: &Arc<Host>, e: &mut Entry) -> Option<Update> {
    let now = fingerprint(&e.sources);
    if now == e.fingerprint {
        return None;
    }
    e.fingerprint = now;
    // Script calls catch their own panics; this catches the host code around them, so a bad
    // edit can never end live reload for the rest of the run.
    let loaded =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| validate::load(host, &e.path, e.role, &e.params)))
            .unwrap_or_else(|_| {
                let name = e.path.display().to_string();
                Err(ScriptError::new(name, "the host failed while checking this version; please report it")
                    .kind(ErrorKind::Panic))
            });
    Some(match loaded {
        Ok(loaded) => {
            // Imports may have changed: follow the new set from now on.
            e.sources = validate::sources(host, &loaded);
            e.fingerprint = fingerprint(&e.sources);
            Update::Swapped { path: e.path.clone(), role: e.role, loaded }
        }
        Err(error) => Update::Rejected { path: e.path.clone(), role: e.role, error },
    })
}

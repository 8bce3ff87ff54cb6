//! `ragen-lab view --serve` (and `train --serve`): a small HTTP server (tiny_http) for the live
//! dashboard. It only reads the run directory, in its own threads (a second process under `view`),
//! so it can neither slow nor stop training. GET only:
//!
//! - `/` the page (no data embedded: it fetches the summary);
//! - `/api/summary` what the page draws first ([`super::summary`]);
//! - `/api/live?since=POS` the updates after POS (the summary's `seq`) as server-sent events, as
//!   they are written (`Last-Event-ID` on a reconnect wins over `since`; a position this server
//!   cannot continue from gets `reset`, and the page fetches the summary again);
//! - `/api/steps?before=STEP&limit=N` rows of the steps table; `/api/events?before=I&limit=N` older
//!   events; `/api/step?step=S&val=0|1` one row per episode of a step; `/api/trajectories?step=S&val=0|1&at=0,1,2`
//!   full trajectories by line; `/api/diff?old=HASH&new=HASH` two script versions' line diff;
//! - any other path: a file under the run directory (plots, rollouts, metrics).
//!
//! Server-sent events on tiny_http: the event stream is a plain HTTP/1.1 answer written by hand on
//! the connection's writer (tiny_http would buffer a body read from a `Read` until it ends), one
//! thread per open page, at most [`MAX_STREAMS`]. One thread polls the run directory
//! ([`super::follow`]) every [`POLL`] and wakes the streams.
//!
//! It binds 127.0.0.1 unless told otherwise, and answers only requests whose `Host` is
//! `localhost` or an IP address: a page on another site that rebinds its own domain name to
//! 127.0.0.1 (DNS rebinding) sends its domain as the Host and gets 403, so it cannot read the run.
use super::follow::Follow;
use anyhow::{anyhow, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tiny_http::{Header, Method, Request, Response, Server};

/// Requests served at once (event streams have threads of their own).
const WORKERS: usize = 4;
/// Open event streams at most; a further page is told to retry later (503).
pub const MAX_STREAMS: usize = 32;
/// How often the run directory is read for new lines.
pub const POLL: Duration = Duration::from_millis(500);
/// A stream with nothing to say sends a comment this often, so a closed page is noticed.
const HEARTBEAT: Duration = Duration::from_secs(15);

/// The follower and the condition its pollers wait on.
struct Shared {
    follow: Mutex<Follow>,
    changed: Condvar,
    streams: AtomicUsize,
}

/// Binds `ip`:`port` (port 0 = any free one), reads the run, calls `ready` with the address,
/// then serves forever. The run directory need not exist yet (`train --serve` starts first).
pub fn serve(dir: &Path, ip: IpAddr, port: u16, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let server = Server::http((ip, port))
        .map_err(|e| anyhow!("cannot listen on {ip}:{port} ({e}); in use? pick another --serve PORT"))?;
    let addr = server.server_addr().to_ip().ok_or_else(|| anyhow!("listening on {ip}:{port}: no IP address"))?;
    let mut follow = Follow::new(dir);
    follow.poll()?;
    let shared = Arc::new(Shared { follow: Mutex::new(follow), changed: Condvar::new(), streams: AtomicUsize::new(0) });
    {
        let shared = shared.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(POLL);
            let mut f = shared.follow.lock().expect("follower lock");
            // A read error (a file being replaced) is retried at the next poll.
            if f.poll().unwrap_or(false) {
                shared.changed.notify_all();
            }
        });
    }
    ready(addr);
    let server = Arc::new(server);
    let workers: Vec<_> = (1..WORKERS)
        .map(|_| {
            let (server, shared) = (server.clone(), shared.clone());
            std::thread::spawn(move || serve_requests(&server, &shared, addr.port()))
        })
        .collect();
    serve_requests(&server, &shared, addr.port());
    for w in workers {
        let _ = w.join();
    }
    Ok(())
}

fn serve_requests(server: &Server, shared: &Arc<Shared>, port: u16) {
    for request in server.incoming_requests() {
        // A client that hangs up mid-answer is its own problem; keep serving.
        let _ = answer(shared, port, request);
    }
}

fn answer(shared: &Arc<Shared>, port: u16, request: Request) -> std::io::Result<()> {
    let header = |name: &'static str| {
        request.headers().iter().find(|h| h.field.equiv(name)).map(|h| h.value.as_str().to_string())
    };
    let (path, query) = request.url().split_once('?').unwrap_or((request.url(), ""));
    let (path, query) = (path.to_string(), params(query));
    let (status, kind, body) = if !header("Host").as_deref().is_some_and(|h| host_allowed(h, port)) {
        (403, "text/plain", b"forbidden: the Host header must be localhost or an IP address\n".to_vec())
    } else if *request.method() != Method::Get {
        (405, "text/plain", b"only GET\n".to_vec())
    } else if path == "/api/live" {
        let since = header("Last-Event-ID").or_else(|| query.get("since").cloned()).unwrap_or_default();
        return stream(shared.clone(), request, since);
    } else {
        respond(shared, &path, &query)
    };
    let header = |k: &str, v: &str| Header::from_bytes(k.as_bytes(), v.as_bytes()).expect("ASCII header");
    let response = Response::from_data(body)
        .with_status_code(status)
        .with_header(header("Content-Type", kind))
        .with_header(header("Cache-Control", "no-store"));
    request.respond(response)
}

/// Sends the updates after `since` as server-sent events, then each new one as it comes, on a
/// thread of its own until the page goes away.
fn stream(shared: Arc<Shared>, request: Request, since: String) -> std::io::Result<()> {
    if shared.streams.fetch_add(1, Ordering::SeqCst) >= MAX_STREAMS {
        shared.streams.fetch_sub(1, Ordering::SeqCst);
        let busy = Response::from_string("too many open dashboards\n").with_status_code(503);
        return request.respond(busy);
    }
    std::thread::spawn(move || {
        let mut out = request.into_writer();
        let _ = send_updates(&shared, &mut out, since);
        shared.streams.fetch_sub(1, Ordering::SeqCst);
    });
    Ok(())
}

fn send_updates(shared: &Shared, out: &mut dyn Write, mut since: String) -> std::io::Result<()> {
    out.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\nConnection: close\r\n\r\nretry: 2000\n\n",
    )?;
    out.flush()?;
    let mut f = shared.follow.lock().expect("follower lock");
    loop {
        let mut text = String::new();
        match f.since(&since) {
            Some(updates) => {
                for u in updates {
                    text += &format!("id: {}\nevent: {}\ndata: {}\n\n", f.id(u.seq), u.kind, u.data);
                }
            }
            // Too far behind, or another server's numbers: the page fetches everything again.
            None => text += &format!("id: {}\nevent: reset\ndata: {{}}\n\n", f.position()),
        }
        since = f.position();
        drop(f);
        out.write_all(if text.is_empty() { b": still here\n\n" } else { text.as_bytes() })?;
        out.flush()?;
        f = shared.follow.lock().expect("follower lock");
        if f.position() == since {
            f = shared.changed.wait_timeout(f, HEARTBEAT).expect("follower lock").0;
        }
    }
}

fn dir_of(shared: &Shared) -> PathBuf {
    shared.follow.lock().expect("follower lock").dir.clone()
}

fn params(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), percent_decode(v).unwrap_or_default()))
        .collect()
}

/// Whether a request's `Host` names this server without a domain name: `localhost` or an IP
/// address, with our port or none. Anything else may be a rebound domain (see the module doc).
pub fn host_allowed(host: &str, port: u16) -> bool {
    let (name, given_port) = match host.rsplit_once(':') {
        // `[::1]:8080` or `127.0.0.1:8080`; a bare IPv6 address has colons but no brackets.
        Some((n, p)) if !n.is_empty() && (n.ends_with(']') || !n.contains(':')) => (n, Some(p)),
        _ => (host, None),
    };
    if given_port.is_some_and(|p| p.parse() != Ok(port)) {
        return false;
    }
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost") || bare.parse::<IpAddr>().is_ok()
}

fn respond(shared: &Shared, path: &str, query: &HashMap<String, String>) -> (u16, &'static str, Vec<u8>) {
    let json_body = |r: Result<Value>| match r {
        Ok(v) => (200, "application/json", serde_json::to_vec(&v).unwrap_or_default()),
        Err(e) => (400, "text/plain", format!("ragen-lab view: {e:#}\n").into_bytes()),
    };
    let num = |k: &str| query.get(k).and_then(|v| v.parse::<u64>().ok());
    let f = || shared.follow.lock().expect("follower lock");
    match path {
        "/" | "/index.html" | "/view/index.html" => {
            (200, "text/html; charset=utf-8", super::page(&Value::Null).into_bytes())
        }
        "/api/summary" => json_body(Ok(super::summary(&f()))),
        "/api/steps" => json_body(Ok(super::step_rows(&f(), num("before"), num("limit").unwrap_or(50) as usize))),
        "/api/events" => {
            let f = f();
            let end = num("before").map_or(f.events.len(), |b| (b as usize).min(f.events.len()));
            let start = end.saturating_sub(num("limit").unwrap_or(200) as usize);
            json_body(Ok(json!({"start": start, "events": &f.events[start..end]})))
        }
        "/api/step" | "/api/trajectories" => {
            let validation = query.get("val").is_some_and(|v| v == "1");
            let file = num("step").and_then(|s| {
                f().rollouts.iter().find(|r| r.step == s && r.validation == validation).map(|r| r.path.clone())
            });
            let Some(file) = file else { return (404, "text/plain", b"no rollouts for that step\n".to_vec()) };
            if path == "/api/step" {
                json_body(
                    crate::metrics::run::read_jsonl(&file).map(|l| json!({"episodes": super::step::episodes(&l)})),
                )
            } else {
                let at: Vec<usize> =
                    query.get("at").map_or(vec![], |a| a.split(',').filter_map(|i| i.parse().ok()).collect());
                json_body(super::step::trajectories(&file, &at).map(Value::from))
            }
        }
        "/api/diff" => {
            let Some(new) = query.get("new") else { return (400, "text/plain", b"diff needs new=HASH\n".to_vec()) };
            json_body(super::diff_json(&dir_of(shared), query.get("old").map(String::as_str), new))
        }
        _ => match file_under(&dir_of(shared), path) {
            Some(p) => match std::fs::read(&p) {
                Ok(b) => (200, content_type(&p), b),
                Err(_) => (404, "text/plain", b"not found\n".to_vec()),
            },
            None => (404, "text/plain", b"not found\n".to_vec()),
        },
    }
}

/// The file a URL path names inside the run directory; None for anything that would leave it.
fn file_under(dir: &Path, url_path: &str) -> Option<PathBuf> {
    let decoded = percent_decode(url_path.trim_start_matches('/'))?;
    let rel = Path::new(&decoded);
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return None;
    }
    let p = dir.join(rel);
    p.is_file().then_some(p)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn content_type(p: &Path) -> &'static str {
    match p.extension().and_then(|e| e.to_str()) {
        Some("html") => "text/html; charset=utf-8",
        Some("json") => "application/json",
        Some("jsonl" | "txt" | "rhai" | "log") => "text/plain; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_cannot_leave_the_run_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        assert!(file_under(dir.path(), "/metrics.jsonl").is_some());
        assert!(file_under(dir.path(), "/../etc/passwd").is_none());
        assert!(file_under(dir.path(), "/%2e%2e/etc/passwd").is_none());
        assert!(file_under(dir.path(), "//etc/passwd").is_none());
        assert!(file_under(dir.path(), "/missing").is_none());
    }

    #[test]
    fn only_localhost_and_ip_hosts_with_our_port_are_answered() {
        for ok in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "::1", "192.168.1.5:8080"] {
            assert!(host_allowed(ok, 8080), "{ok}");
        }
        for bad in ["evil.example:8080", "evil.example", "127.0.0.1:9999", "localhost.evil.example:8080", "", ":8080"] {
            assert!(!host_allowed(bad, 8080), "{bad}");
        }
    }
}

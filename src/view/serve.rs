//! `ragen-lab view --serve`: a small HTTP server (tiny_http) for following a live run. `/`
//! rebuilds the viewer page from the run directory on every request (so a reload shows new
//! steps), `/data.json` is the same data alone, and any other path is a file under the run
//! directory (plots, rollouts, metrics). GET only.
//!
//! Several requests are served at once (a browser's idle pre-connection does not stall the
//! others). It binds 127.0.0.1 unless told otherwise, and answers only requests whose `Host` is
//! `localhost` or an IP address: a page on another site that rebinds its own domain name to
//! 127.0.0.1 (DNS rebinding) sends its domain as the Host and gets 403, so it cannot read the run.
use crate::metrics::run::Run;
use anyhow::{anyhow, Result};
use std::net::{IpAddr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use tiny_http::{Header, Method, Request, Response, Server};

/// Requests served at once.
const WORKERS: usize = 4;

/// Binds `ip`:`port` (port 0 = any free one), calls `ready` with the address, then serves forever.
pub fn serve(dir: &Path, ip: IpAddr, port: u16, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let server = Server::http((ip, port))
        .map_err(|e| anyhow!("cannot listen on {ip}:{port} ({e}); in use? pick another --serve PORT"))?;
    let addr = server.server_addr().to_ip().ok_or_else(|| anyhow!("listening on {ip}:{port}: no IP address"))?;
    ready(addr);
    let server = Arc::new(server);
    let workers: Vec<_> = (1..WORKERS)
        .map(|_| {
            let (server, dir) = (server.clone(), dir.to_path_buf());
            std::thread::spawn(move || serve_requests(&server, &dir, addr.port()))
        })
        .collect();
    serve_requests(&server, dir, addr.port());
    for w in workers {
        let _ = w.join();
    }
    Ok(())
}

fn serve_requests(server: &Server, dir: &Path, port: u16) {
    for request in server.incoming_requests() {
        // A client that hangs up mid-answer is its own problem; keep serving.
        let _ = answer(dir, port, request);
    }
}

fn answer(dir: &Path, port: u16, request: Request) -> std::io::Result<()> {
    let host = request.headers().iter().find(|h| h.field.equiv("Host")).map(|h| h.value.as_str().to_string());
    let (status, kind, body) = if !host.as_deref().is_some_and(|h| host_allowed(h, port)) {
        (403, "text/plain", b"forbidden: the Host header must be localhost or an IP address\n".to_vec())
    } else if *request.method() != Method::Get {
        (405, "text/plain", b"only GET\n".to_vec())
    } else {
        let path = request.url().split(['?', '#']).next().unwrap_or("/").to_string();
        respond(dir, &path)
    };
    let header = |k: &str, v: &str| Header::from_bytes(k.as_bytes(), v.as_bytes()).expect("ASCII header");
    let response = Response::from_data(body)
        .with_status_code(status)
        .with_header(header("Content-Type", kind))
        .with_header(header("Cache-Control", "no-store"));
    request.respond(response)
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

fn respond(dir: &Path, path: &str) -> (u16, &'static str, Vec<u8>) {
    let rebuilt = |f: fn(&serde_json::Value) -> Vec<u8>| match Run::open(dir).and_then(|r| super::data(&r)) {
        Ok(d) => (200, f(&d)),
        Err(e) => (500, format!("ragen-lab view: {e:#}\n").into_bytes()),
    };
    match path {
        "/" | "/index.html" | "/view/index.html" => {
            let (status, body) = rebuilt(|d| super::page(d).into_bytes());
            (status, if status == 200 { "text/html; charset=utf-8" } else { "text/plain" }, body)
        }
        "/data.json" => {
            let (status, body) = rebuilt(|d| serde_json::to_vec(d).unwrap_or_default());
            (status, "application/json", body)
        }
        _ => match file_under(dir, path) {
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

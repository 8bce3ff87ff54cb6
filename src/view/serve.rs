//! `ragen-lab view --serve`: a tiny loopback HTTP server for following a live run. `/` rebuilds
//! the viewer page from the run directory on every request (so a reload shows new steps),
//! `/data.json` is the same data alone, and any other path is a file under the run directory
//! (plots, rollouts, metrics). One request at a time, GET only, no keep-alive: it serves one user.
use crate::metrics::run::Run;
use anyhow::{Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// Binds 127.0.0.1:`port` (0 = any free port), calls `ready` with the address, then serves forever.
pub fn serve(dir: &Path, port: u16, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        .with_context(|| format!("cannot listen on 127.0.0.1:{port} (in use? pick another --serve PORT)"))?;
    ready(listener.local_addr()?);
    // A client that fails to connect or hangs up mid-request is its own problem; keep serving.
    for s in listener.incoming().flatten() {
        let _ = handle(dir, s);
    }
    Ok(())
}

fn handle(dir: &Path, mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    // Drain the headers; nothing in them changes the answer.
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let mut parts = request.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    let path = target.split(['?', '#']).next().unwrap_or("/");
    let (status, kind, body) = if method != "GET" {
        ("405 Method Not Allowed", "text/plain", b"only GET\n".to_vec())
    } else {
        respond(dir, path)
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(&body)?;
    stream.flush()
}

fn respond(dir: &Path, path: &str) -> (&'static str, &'static str, Vec<u8>) {
    let rebuilt = |f: fn(&serde_json::Value) -> Vec<u8>| match Run::open(dir).and_then(|r| super::data(&r)) {
        Ok(d) => ("200 OK", f(&d)),
        Err(e) => ("500 Internal Server Error", format!("ragen-lab view: {e:#}\n").into_bytes()),
    };
    match path {
        "/" | "/index.html" | "/view/index.html" => {
            let (status, body) = rebuilt(|d| super::page(d).into_bytes());
            (status, if status.starts_with("200") { "text/html; charset=utf-8" } else { "text/plain" }, body)
        }
        "/data.json" => {
            let (status, body) = rebuilt(|d| serde_json::to_vec(d).unwrap_or_default());
            (status, "application/json", body)
        }
        _ => match file_under(dir, path) {
            Some(p) => match std::fs::read(&p) {
                Ok(b) => ("200 OK", content_type(&p), b),
                Err(_) => ("404 Not Found", "text/plain", b"not found\n".to_vec()),
            },
            None => ("404 Not Found", "text/plain", b"not found\n".to_vec()),
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
}

//! A blocking client for an OpenAI-compatible endpoint (ureq): retries with exponential backoff
//! on 429, 5xx and dropped connections (honouring `Retry-After`), a per-request timeout, and
//! errors that say what to fix (a wrong URL, a model the server does not have). The API key goes
//! in the `Authorization` header only; it is never printed (Debug hides it).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::wire::{ChatRequest, ChatResponse, CompletionRequest, CompletionResponse};

pub struct Endpoint {
    /// The API root, ending in `/v1`.
    pub base: String,
    api_key: Option<String>,
    agent: ureq::Agent,
    /// Attempts after the first one.
    pub retries: usize,
    /// The first wait; each retry doubles it.
    pub backoff: Duration,
    /// Retries made so far (all requests together).
    pub retried: AtomicUsize,
    /// Connections that failed or dropped (the server may have restarted since).
    pub dropped: AtomicUsize,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = if self.api_key.is_some() { "<set>" } else { "<none>" };
        write!(f, "Endpoint {{ base: {:?}, api_key: {key}, retries: {} }}", self.base, self.retries)
    }
}

/// The API root for what a user typed: `http://host:8000`, `http://host:8000/` and
/// `http://host:8000/v1` all mean `http://host:8000/v1`.
pub fn api_base(url: &str) -> Result<String> {
    let url = url.trim().trim_end_matches('/');
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        bail!("--endpoint {url:?}: expected an http:// or https:// URL, such as http://127.0.0.1:8000/v1");
    }
    Ok(if url.ends_with("/v1") { url.to_string() } else { format!("{url}/v1") })
}

impl Endpoint {
    pub fn new(url: &str, api_key: Option<String>, timeout: Duration) -> Result<Self> {
        let agent = ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(10)).timeout(timeout).build();
        Ok(Self {
            base: api_base(url)?,
            api_key,
            agent,
            retries: 5,
            backoff: Duration::from_millis(500),
            retried: AtomicUsize::new(0),
            dropped: AtomicUsize::new(0),
        })
    }

    pub fn chat(&self, req: &ChatRequest) -> Result<ChatResponse> {
        self.post("/chat/completions", req, &req.model)
    }

    pub fn completions(&self, req: &CompletionRequest) -> Result<CompletionResponse> {
        self.post("/completions", req, &req.model)
    }

    /// The model names `GET /models` lists.
    pub fn models(&self) -> Result<Vec<String>> {
        let v: serde_json::Value = self.send(|| self.request("GET", "/models").call())?;
        Ok(v["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str().map(String::from)).collect())
    }

    /// POST `body` to `path` under the API root; the answer's body is not read.
    pub fn post_value(&self, path: &str, body: &impl Serialize) -> Result<()> {
        let body = serde_json::to_value(body)?;
        self.send::<serde_json::Value>(|| self.request("POST", path).send_json(&body)).map(drop)
    }

    /// The same at the server root (SGLang's admin routes are not under /v1).
    pub fn post_value_at_root(&self, path: &str, body: &impl Serialize) -> Result<()> {
        let body = serde_json::to_value(body)?;
        let root = self.base.trim_end_matches("/v1");
        self.send::<serde_json::Value>(|| self.with_key(self.agent.post(&format!("{root}{path}"))).send_json(&body))
            .map(drop)
    }

    fn with_key(&self, r: ureq::Request) -> ureq::Request {
        match &self.api_key {
            Some(k) => r.set("Authorization", &format!("Bearer {k}")),
            None => r,
        }
    }

    fn request(&self, method: &str, path: &str) -> ureq::Request {
        self.with_key(self.agent.request(method, &format!("{}{path}", self.base)))
    }

    fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize, model: &str) -> Result<T> {
        let body = serde_json::to_value(body)?;
        self.send(|| self.request("POST", path).send_json(&body)).map_err(|e| self.explain(e, model))
    }

    /// Sends with retries; a refusal that retrying cannot fix returns at once.
    fn send<T: DeserializeOwned>(&self, call: impl Fn() -> Result<ureq::Response, ureq::Error>) -> Result<T> {
        let mut wait = self.backoff;
        for attempt in 0..=self.retries {
            let last = attempt == self.retries;
            match call() {
                Ok(resp) => {
                    let text = resp.into_string().map_err(|e| anyhow!("{}: reading the answer: {e}", self.base))?;
                    return serde_json::from_str(&text).map_err(|e| {
                        anyhow!("{}: the answer is not the expected JSON ({e}): {}", self.base, clip(&text))
                    });
                }
                Err(ureq::Error::Status(code, resp)) if (code == 429 || code >= 500) && !last => {
                    let after = resp.header("Retry-After").and_then(|s| s.trim().parse::<f64>().ok());
                    std::thread::sleep(after.map(Duration::from_secs_f64).unwrap_or(wait).min(Duration::from_secs(60)));
                }
                Err(ureq::Error::Status(code, resp)) => {
                    let text = resp.into_string().unwrap_or_default();
                    let msg = serde_json::from_str::<serde_json::Value>(&text)
                        .ok()
                        .and_then(|v| v["error"]["message"].as_str().map(String::from))
                        .unwrap_or_else(|| clip(&text));
                    return Err(Refused { code, message: msg }.into());
                }
                Err(ureq::Error::Transport(_)) if !last => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(wait);
                }
                Err(ureq::Error::Transport(t)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    bail!(
                        "cannot reach {} after {} attempts ({t}): is the server running, and is --endpoint right?",
                        self.base,
                        self.retries + 1
                    )
                }
            }
            self.retried.fetch_add(1, Ordering::Relaxed);
            wait *= 2;
        }
        unreachable!("the last attempt returns")
    }

    /// A refused request, with the served models when the model name is the likely cause.
    fn explain(&self, e: anyhow::Error, model: &str) -> anyhow::Error {
        let Some(r) = e.downcast_ref::<Refused>() else { return e };
        if matches!(r.code, 400 | 404) && r.message.to_lowercase().contains("model") {
            if let Ok(names) = self.models() {
                if !names.iter().any(|n| n == model) {
                    return anyhow!(
                        "{}: no model {model:?} there ({}); it serves: {}",
                        self.base,
                        r.message,
                        names.join(", ")
                    );
                }
            }
        }
        anyhow!("{}: HTTP {}: {}", self.base, r.code, r.message)
    }
}

/// A 4xx (or a 5xx after the last retry).
#[derive(Debug)]
pub struct Refused {
    pub code: u16,
    pub message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.code, self.message)
    }
}

impl std::error::Error for Refused {}

fn clip(text: &str) -> String {
    let t = text.trim();
    match t.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &t[..i]),
        None => t.to_string(),
    }
}

//! `ragen-lab bench serve`: concurrent chat requests against an OpenAI-compatible server
//! (`ragen-lab serve` started in this process, or any endpoint: llama-server, vLLM), reported as
//! throughput and latency per concurrency level, with the ratio to one request at a time.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use serde_json::{json, Value};

/// One concurrency level's outcome.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadResult {
    pub concurrency: usize,
    pub requests: usize,
    pub errors: usize,
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub completion_tokens_per_s: f64,
    pub latency_p50_s: f64,
    pub latency_p99_s: f64,
}

/// The requests one level sends: one user message, `prompt` after a per-request number (so no
/// server can skip a prefill through its prompt cache), `max_tokens` each, sampled at
/// temperature 1 with per-request seeds.
pub struct Load<'a> {
    pub chat_url: &'a str,
    pub model: &'a str,
    pub prompt: &'a str,
    pub max_tokens: usize,
    pub requests: usize,
    pub timeout: Duration,
}

/// The q-quantile (0..=1) of sorted `xs`, by nearest rank.
fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs[((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len()) - 1]
}

impl Load<'_> {
    /// `requests` chat completions with `concurrency` in flight at once.
    pub fn run(&self, concurrency: usize) -> Result<LoadResult> {
        let next = AtomicUsize::new(0);
        let done = Mutex::new((Vec::new(), 0usize, 0usize)); // latencies, completion tokens, errors
        let start = Instant::now();
        std::thread::scope(|scope| {
            for k in 0..concurrency.max(1) {
                // A client per thread, each with its own connection, as separate users have.
                let agent =
                    ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(10)).timeout(self.timeout).build();
                let (next, done) = (&next, &done);
                scope.spawn(move || {
                    // Clients arrive 5 ms apart: a burst of simultaneous first connections from
                    // this process left some stalled 12-15 s against both ragen-lab serve and
                    // llama-server (a Python client hitting the same servers does not see it).
                    std::thread::sleep(Duration::from_millis(5 * k as u64));
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= self.requests {
                            break;
                        }
                        let messages = json!([{"role": "user", "content": format!("Game {i}. {}", self.prompt)}]);
                        let body = json!({"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                            "temperature": 1.0, "top_p": 1.0, "seed": i});
                        let t = Instant::now();
                        let answer = agent
                            .post(self.chat_url)
                            .send_json(body)
                            .map_err(|e| e.to_string())
                            .and_then(|r| r.into_json::<Value>().map_err(|e| e.to_string()));
                        let mut d = done.lock().expect("load results");
                        match answer {
                            Ok(v) => {
                                d.0.push(t.elapsed().as_secs_f64());
                                d.1 += v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
                            }
                            Err(e) => {
                                if d.2 == 0 {
                                    eprintln!("bench serve: a request failed: {e}");
                                }
                                d.2 += 1;
                            }
                        }
                    }
                });
            }
        });
        let wall_s = start.elapsed().as_secs_f64();
        let (mut lat, tokens, errors) = done.into_inner().map_err(|_| anyhow!("a client thread panicked"))?;
        lat.sort_by(f64::total_cmp);
        Ok(LoadResult {
            concurrency,
            requests: self.requests,
            errors,
            wall_s,
            requests_per_s: lat.len() as f64 / wall_s,
            completion_tokens_per_s: tokens as f64 / wall_s,
            latency_p50_s: quantile(&lat, 0.5),
            latency_p99_s: quantile(&lat, 0.99),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_are_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((quantile(&xs, 0.5), quantile(&xs, 0.99), quantile(&xs, 1.0)), (50.0, 99.0, 100.0));
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}

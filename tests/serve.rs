//! `ragen-lab serve` and `ragen-lab eval` on the tiny random-weight model: eval through the
//! server plays the trainer's own validation (the same prompts token for token, so the same
//! replies at a near-greedy temperature); streaming, token ids and log-probs honour the
//! contract; a wrong model or URL is a clear error; 503s are retried; an interrupted eval
//! continues without replaying what it finished.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc::channel;
use std::sync::OnceLock;
use std::time::Duration;

use ragen_lab::policy::{Policy, TokenBatch};
use ragen_lab::remote::wire::{ChatMessage, ChatRequest, ChatResponse, CompletionRequest, Prompt, Sampling};
use ragen_lab::remote::Endpoint;
use ragen_lab::starpo::eval::{eval, Options, Summary};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_ragen-lab");

/// One tiny-llama server for the whole file (port chosen by the OS).
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let opts = ragen_lab::serve::Options {
                model: "tiny-llama".into(),
                name: None,
                ip: "127.0.0.1".parse().unwrap(),
                port: 0,
                max_batch: 64,
                seed: 0,
            };
            ragen_lab::serve::serve(opts, |addr| tx.send(addr).unwrap()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(60)).expect("the server starts")
    })
}

fn url() -> String {
    format!("http://{}/v1", server())
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Unconstrained (the endpoint samples freely) and near-greedy, so both sides pick the same
/// tokens wherever the model has a clear favourite.
const SETS: &[&str] = &["rollout.constrain_actions=false", "train.val_temperature=0.001", "train.val_groups=16"];

fn eval_into(dir: &Path, model: &str, endpoint: &str, sets: &[&str], retries: usize) -> anyhow::Result<Summary> {
    eval(Options {
        experiment: root().join("scripts/bandit_tiny.rhai"),
        endpoint: endpoint.to_string(),
        model: model.to_string(),
        api_key: None,
        seeds: None,
        concurrency: 4,
        sets: sets.iter().map(|s| s.to_string()).collect(),
        run_dir: dir.to_path_buf(),
        timeout: Duration::from_secs(60),
        retries,
        plain_api: false,
        progress: false,
    })
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn responses(line: &Value) -> Vec<String> {
    line["turns"].as_array().unwrap().iter().map(|t| t["response"].as_str().unwrap().to_string()).collect()
}

#[test]
fn eval_through_serve_plays_the_trainers_validation() {
    let tmp = tempfile::tempdir().unwrap();
    let (trained, evaluated) = (tmp.path().join("train"), tmp.path().join("eval"));
    let mut c = Command::new(BIN);
    c.current_dir(root()).args(["train", "--env", "scripts/bandit_tiny.rhai", "--steps", "0", "--quiet", "--run-dir"]);
    c.arg(&trained).args(["--set", "train.val_every=1"]);
    for s in SETS {
        c.args(["--set", s]);
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let summary = eval_into(&evaluated, "tiny-llama", &url(), SETS, 0).unwrap();
    assert_eq!(summary.played, 32, "16 seeds × 1 sample × 2 variants");
    for file in ["val-step-000000.jsonl", "val-heldout-step-000000.jsonl"] {
        let (a, b) = (lines(&trained.join("rollouts").join(file)), lines(&evaluated.join("rollouts").join(file)));
        assert_eq!(a.len(), b.len());
        let same = a.iter().zip(&b).filter(|(x, y)| responses(x) == responses(y)).count();
        // Batches of other shapes round differently: a near-tie may go the other way.
        assert!(same * 10 >= a.len() * 8, "{file}: only {same} of {} episodes replied alike", a.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!((&x["seed"], &x["group"], &x["episode"]), (&y["seed"], &y["group"], &y["episode"]));
            assert_eq!(x["turns"][0]["user"], y["turns"][0]["user"], "the same prompt");
            if responses(x) == responses(y) {
                assert_eq!((&x["success"], &x["score"]), (&y["success"], &y["score"]), "same reply, same outcome");
            }
        }
    }
    // The run directory reads like a training run's.
    let events = lines(&evaluated.join("events.jsonl"));
    let v = events.iter().find(|e| e["kind"] == "validation").expect("a validation event");
    assert_eq!(v["val/success"].as_f64(), Some(summary.variants[0].success));
    let run = ragen_lab::metrics::run::Run::open(&evaluated).unwrap();
    assert!(run.rollouts.iter().any(|r| r.validation && r.step == 0), "{:?}", run.rollouts);
}

#[test]
fn an_interrupted_eval_continues_without_replaying_finished_episodes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("eval");
    let first = eval_into(&dir, "tiny-llama", &url(), SETS, 0).unwrap();
    assert_eq!(first.played, 32);
    // As if killed: the last 5 episodes of the training variant never finished.
    let file = dir.join("rollouts/val-step-000000.jsonl");
    let kept: String = lines(&file)[..11].iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&file, kept).unwrap();
    let second = eval_into(&dir, "tiny-llama", &url(), SETS, 0).unwrap();
    assert_eq!(second.played, 5);
    assert_eq!(second.variants[0].episodes, 16);
    assert_eq!(lines(&file).len(), 16);
    // Another setting is another eval: refused, nothing overwritten.
    let e = eval_into(&dir, "tiny-llama", &url(), &["train.val_groups=8"], 0).unwrap_err();
    assert!(format!("{e:#}").contains("pick another --run-dir"), "{e:#}");
}

#[test]
fn a_wrong_model_or_url_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = eval_into(&tmp.path().join("a"), "gpt-nope", &url(), SETS, 0).unwrap_err();
    assert!(format!("{e:#}").contains("no model \"gpt-nope\"; it serves: tiny-llama"), "{e:#}");
    // A port nobody listens on.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = eval_into(&tmp.path().join("b"), "tiny-llama", &format!("http://{free}"), SETS, 1).unwrap_err();
    assert!(format!("{e:#}").contains("cannot reach"), "{e:#}");
}

fn chat_request(stream: bool) -> ChatRequest {
    ChatRequest {
        model: "tiny-llama".into(),
        messages: vec![ChatMessage { role: "user".into(), content: "Pick an arm.".into() }],
        sampling: Sampling { max_tokens: Some(12), temperature: Some(0.0), stream, ..Sampling::default() },
        ..ChatRequest::default()
    }
}

#[test]
fn a_streamed_reply_arrives_in_pieces_that_make_the_whole_reply() {
    let whole: ChatResponse =
        Endpoint::new(&url(), None, Duration::from_secs(60)).unwrap().chat(&chat_request(false)).unwrap();
    let body = ureq::post(&format!("{}/chat/completions", url()))
        .send_json(serde_json::to_value(chat_request(true)).unwrap())
        .unwrap()
        .into_string()
        .unwrap();
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, whole.choices[0].message.content);
    assert!(chunks.len() > 3, "streamed in pieces, not in one: {body}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[test]
fn completions_take_ids_and_return_ids_with_the_models_logprobs() {
    let policy = Policy::load("tiny-llama", &ragen_lab::policy::device().unwrap()).unwrap();
    let prompt = policy.encode_plain("The bandit has two arms").unwrap();
    let req = CompletionRequest {
        model: "tiny-llama".into(),
        prompt: Prompt::Ids(prompt.clone()),
        sampling: Sampling {
            max_tokens: Some(6),
            temperature: Some(1.0),
            return_token_ids: Some(true),
            ..Sampling::default()
        },
        logprobs: Some(0),
    };
    let resp = Endpoint::new(&url(), None, Duration::from_secs(60)).unwrap().completions(&req).unwrap();
    let c = &resp.choices[0];
    assert_eq!(c.prompt_token_ids.as_ref(), Some(&prompt));
    let ids = c.token_ids.clone().unwrap();
    let lps = &c.logprobs.as_ref().unwrap().token_logprobs;
    assert_eq!((ids.len(), lps.len(), resp.usage.completion_tokens), (6, 6, 6));
    // At temperature 1 they are the model's own log-probs of the sampled ids.
    let full = [prompt.clone(), ids.clone()].concat();
    let scored = policy.token_logprobs_no_grad(&TokenBatch::new(&[full], policy.pad_id).unwrap()).unwrap();
    let mine = scored.logprobs.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
    for (i, lp) in lps.iter().enumerate() {
        let want = mine[prompt.len() + i];
        assert!((lp - want).abs() < 1e-3, "token {i}: served {lp}, scored {want}");
    }
    // A prompt id outside the vocabulary is the client's error.
    let bad = CompletionRequest { prompt: Prompt::Ids(vec![u32::MAX]), ..req };
    let e = Endpoint::new(&url(), None, Duration::from_secs(60)).unwrap().completions(&bad).unwrap_err();
    assert!(format!("{e:#}").contains("HTTP 400") && format!("{e:#}").contains("outside the vocabulary"), "{e:#}");
}

#[test]
fn busy_answers_are_retried_with_backoff() {
    // A fake endpoint: 503 twice, then a chat answer.
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let addr = server.server_addr().to_ip().unwrap();
    std::thread::spawn(move || {
        for (i, req) in server.incoming_requests().enumerate() {
            let resp = if i < 2 {
                tiny_http::Response::from_string("busy").with_status_code(503)
            } else {
                let body = json!({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Up</answer>"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}});
                tiny_http::Response::from_string(body.to_string())
            };
            let _ = req.respond(resp);
        }
    });
    let mut ep = Endpoint::new(&format!("http://{addr}"), Some("secret-key".into()), Duration::from_secs(10)).unwrap();
    ep.backoff = Duration::from_millis(10);
    let r = ep.chat(&ChatRequest { model: "m".into(), ..ChatRequest::default() }).unwrap();
    assert_eq!(r.choices[0].message.content, "Up</answer>");
    assert_eq!(ep.retried.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(!format!("{ep:?}").contains("secret-key"), "the key is never printed");
}

#[test]
fn a_seeded_request_samples_the_same_tokens_alone_or_batched_with_others() {
    let ask = |text: &str, seed: u64| ChatRequest {
        model: "tiny-llama".into(),
        messages: vec![ChatMessage { role: "user".into(), content: text.into() }],
        sampling: Sampling { max_tokens: Some(16), temperature: Some(1.0), seed: Some(seed), ..Sampling::default() },
        ..ChatRequest::default()
    };
    let send = |req: &ChatRequest| -> String {
        let resp = Endpoint::new(&url(), None, Duration::from_secs(60)).unwrap().chat(req).unwrap();
        resp.choices[0].message.content.clone()
    };
    let alone = send(&ask("Pick an arm.", 7));
    // The same request among seven others sent at once: the server batches what arrives together.
    let batched = std::thread::scope(|s| {
        let others: Vec<_> =
            (0..7).map(|i| s.spawn(move || send(&ask(&format!("Arm number {i}, please."), 100 + i)))).collect();
        let mine = s.spawn(|| send(&ask("Pick an arm.", 7)));
        others.into_iter().for_each(|h| drop(h.join().unwrap()));
        mine.join().unwrap()
    });
    assert_eq!(batched, alone);
    // The seed decides the draws: other seeds give other replies.
    let others: Vec<String> = (8..12).map(|seed| send(&ask("Pick an arm.", seed))).collect();
    assert!(others.iter().any(|r| *r != alone), "{alone:?} for every seed: {others:?}");
}

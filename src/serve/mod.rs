//! `ragen-lab serve`: an OpenAI-compatible HTTP server (tiny_http) for a base model, a
//! checkpoint or a LoRA adapter. Routes: `GET /health`, `GET /v1/models`,
//! `POST /v1/chat/completions` and `POST /v1/completions`, streaming (server-sent events) or
//! not, with the sampled tokens' log-probs and token ids in and out (see `remote::wire` for the
//! extensions). Weights change as on the engines an RL run syncs to: `POST /v1/load_lora_adapter`
//! and `/v1/unload_lora_adapter` (vLLM's routes and bodies; the adapter is then requested by
//! name) and `POST /update_weights_from_disk` (SGLang's). Every request runs on its own thread;
//! generation runs on one (`batcher`), which batches concurrent requests into the sampler.
//!
//! Log-probs are those of the sampling distribution, softmax(logits / temperature) before top-k
//! and top-p, the distribution RL trains on (at temperature 1 they are the raw ones; vLLM's
//! default and llama-server's are the raw ones at any temperature).
pub mod batcher;
pub mod load;

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, RwLock};

use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response, Server};

use crate::policy::constrain::AnswerGrammar;
use crate::policy::{device, lora, Finish, Generation, GenerationConfig, Message, Policy};
use crate::remote::wire::{
    error_body, ChatChoice, ChatLogprobs, ChatMessage, ChatRequest, ChatResponse, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, LoadLora, Prompt, Sampling, TokenLogprob, UpdateFromDisk, Usage,
};
use crate::starpo::rundir::{now, RunDir};
use batcher::Job;

/// Tokens a request may generate when it does not say (`max_tokens`).
const DEFAULT_MAX_TOKENS: usize = 512;

pub struct Options {
    /// A model (`--model` forms), a run directory (its latest checkpoint), a checkpoint
    /// directory or a PEFT adapter folder.
    pub model: String,
    /// The name clients put in `model` (default: `model` as given).
    pub name: Option<String>,
    pub ip: IpAddr,
    /// 0 = any free port.
    pub port: u16,
    /// Most requests in one generation batch.
    pub max_batch: usize,
    /// Seed of the server's sampler.
    pub seed: u64,
}

/// What every request handler shares.
struct Served {
    /// The served weights by the name clients ask for: the base model first, then the adapters
    /// loaded on it (`/v1/load_lora_adapter`).
    models: RwLock<Vec<(String, Arc<Policy>)>>,
    jobs: Sender<Job>,
}

impl Served {
    fn base(&self) -> (String, Arc<Policy>) {
        self.models.read().expect("models lock")[0].clone()
    }

    fn get(&self, model: &str) -> Result<Arc<Policy>, Refusal> {
        let models = self.models.read().expect("models lock");
        if let Some((_, p)) = models.iter().find(|(n, _)| n == model) {
            return Ok(p.clone());
        }
        let names: Vec<&str> = models.iter().map(|(n, _)| n.as_str()).collect();
        Err(Refusal(404, format!("The model `{model}` does not exist; this server has `{}`.", names.join("`, `"))))
    }
}

/// Loads the model, binds `ip:port`, calls `ready` with the address, then serves until the
/// process ends.
pub fn serve(opts: Options, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let policy = Arc::new(load_served(&opts.model)?);
    let server = Server::http((opts.ip, opts.port))
        .map_err(|e| anyhow!("cannot listen on {}:{} ({e}); in use? pick another --port", opts.ip, opts.port))?;
    let addr = server.server_addr().to_ip().ok_or_else(|| anyhow!("listening on {}: no IP address", opts.ip))?;
    let jobs = batcher::start(opts.max_batch, opts.seed);
    let name = opts.name.unwrap_or(opts.model);
    let served = Arc::new(Served { models: RwLock::new(vec![(name, policy)]), jobs });
    ready(addr);
    for request in server.incoming_requests() {
        let served = served.clone();
        std::thread::spawn(move || {
            // A client that hangs up mid-answer is its own problem; keep serving.
            let _ = answer(&served, request);
        });
    }
    Ok(())
}

/// The policy `spec` names: a run directory's latest checkpoint, a checkpoint, a LoRA adapter
/// folder (on the base it names), or anything `Policy::load` takes.
pub fn load_served(spec: &str) -> Result<Policy> {
    let path = Path::new(spec);
    let dir = if path.join("settings.json").is_file() {
        RunDir::latest_checkpoint(path)?.join("policy")
    } else if path.join("policy").is_dir() {
        path.join("policy")
    } else {
        path.to_path_buf()
    };
    let device = device()?;
    if lora::is_adapter_dir(&dir) {
        let base = lora::base_of(&dir)?;
        return Policy::load(&base, &device)?.load_saved(&dir);
    }
    let spec = if dir.is_dir() { dir.to_string_lossy().to_string() } else { spec.to_string() };
    Policy::load(&spec, &device).with_context(|| format!("serve: loading {spec}"))
}

/// A refused request: status and message.
struct Refusal(u16, String);

impl<E: std::fmt::Display> From<E> for Refusal {
    fn from(e: E) -> Self {
        Refusal(500, e.to_string())
    }
}

fn bad(msg: impl Into<String>) -> Refusal {
    Refusal(400, msg.into())
}

fn answer(served: &Served, mut request: Request) -> std::io::Result<()> {
    let path = request.url().split(['?', '#']).next().unwrap_or("/").to_string();
    let mut body = String::new();
    let read = request.as_reader().read_to_string(&mut body);
    let result = match (request.method(), path.as_str()) {
        _ if read.is_err() => Err(bad("the request body is not UTF-8 text")),
        (Method::Get, "/health") => Ok(json!({"status": "ok"})),
        (Method::Get, "/v1/models") => {
            let models = served.models.read().expect("models lock");
            let data: Vec<Value> = models
                .iter()
                .map(|(id, _)| json!({"id": id, "object": "model", "created": 0, "owned_by": "ragen-lab"}))
                .collect();
            Ok(json!({"object": "list", "data": data}))
        }
        (Method::Post, "/v1/load_lora_adapter" | "/load_lora_adapter") => {
            parse(&body).and_then(|r| load_lora(served, r))
        }
        (Method::Post, "/v1/unload_lora_adapter" | "/unload_lora_adapter") => {
            parse::<Value>(&body).and_then(|r| unload_lora(served, r["lora_name"].as_str().unwrap_or_default()))
        }
        (Method::Post, "/update_weights_from_disk") => parse(&body).and_then(|r| update_from_disk(served, r)),
        (Method::Post, "/v1/chat/completions") => match parse::<ChatRequest>(&body) {
            Ok(req) => return chat(served, request, req),
            Err(r) => Err(r),
        },
        (Method::Post, "/v1/completions") => match parse::<CompletionRequest>(&body) {
            Ok(req) => return completions(served, request, req),
            Err(r) => Err(r),
        },
        _ => Err(Refusal(404, format!("no route {} {path}", request.method()))),
    };
    respond(request, result)
}

fn parse<T: serde::de::DeserializeOwned>(body: &str) -> Result<T, Refusal> {
    serde_json::from_str(body).map_err(|e| bad(format!("invalid request: {e}")))
}

fn respond(request: Request, result: Result<Value, Refusal>) -> std::io::Result<()> {
    let (status, body) = match result {
        Ok(v) => (200, v),
        Err(Refusal(code, msg)) => {
            let kind = if code >= 500 { "InternalServerError" } else { "BadRequestError" };
            (code, error_body(&msg, kind, code))
        }
    };
    let header = Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..]).expect("ASCII header");
    request.respond(Response::from_string(body.to_string()).with_status_code(status).with_header(header))
}

/// What a request asks the sampler, checked.
struct Asked {
    policy: Arc<Policy>,
    prompt: Vec<u32>,
    cfg: GenerationConfig,
    stops: Vec<String>,
    keep_stop: bool,
    seed: Option<u64>,
}

fn asked(policy: &Arc<Policy>, prompt: Vec<u32>, s: &Sampling) -> Result<Asked, Refusal> {
    let vocab = policy.model.cfg.vocab_size as u32;
    if let Some(id) = prompt.iter().find(|&&id| id >= vocab) {
        return Err(bad(format!("token id {id} is outside the vocabulary ({vocab})")));
    }
    if prompt.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    let max_tokens = s.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let context = policy.model.cfg.max_position_embeddings;
    if prompt.len() + max_tokens > context {
        return Err(bad(format!(
            "This model's maximum context length is {context} tokens; the prompt has {} and max_tokens is {max_tokens}.",
            prompt.len()
        )));
    }
    let temperature = s.temperature.unwrap_or(1.0);
    let top_p = s.top_p.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) || !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad("temperature must be in [0, 2] and top_p in (0, 1]"));
    }
    let stops: Vec<String> = s.stop.as_ref().map(|x| x.strings()).unwrap_or_default();
    let cfg = GenerationConfig {
        max_new_tokens: max_tokens,
        temperature,
        top_p,
        top_k: s.top_k.unwrap_or(0).max(0) as usize,
        stop_strings: stops.clone(),
        constraint: s
            .answer_grammar
            .as_ref()
            .and_then(|g| AnswerGrammar::new(&g.actions, g.max_actions, g.starts_inside))
            .map(|g| policy.canonical(g)),
        ..GenerationConfig::default()
    };
    let keep_stop = s.include_stop_str_in_output.unwrap_or(false);
    Ok(Asked { policy: policy.clone(), prompt, cfg, stops, keep_stop, seed: s.seed })
}

fn chat(served: &Served, request: Request, req: ChatRequest) -> std::io::Result<()> {
    let p = match served.get(&req.model) {
        Ok(p) => p,
        Err(r) => return respond(request, Err(r)),
    };
    let messages: Vec<Message> = req.messages.iter().map(|m| Message::new(&m.role, m.content.clone())).collect();
    // `continue_final_message`: the last (assistant) message is a prefix the reply continues,
    // tokenised on its own after the generation prompt, as the trainer opens a turn.
    let prompt = match (req.continue_final_message.unwrap_or(false), messages.split_last()) {
        (true, Some((last, head))) if last.role == "assistant" => {
            p.chat_tokens(head, true).and_then(|c| Ok([c.ids, p.encode_plain(&last.content)?].concat()))
        }
        (true, _) => return respond(request, Err(bad("continue_final_message needs a final assistant message"))),
        (false, _) => p.chat_tokens(&messages, req.add_generation_prompt.unwrap_or(true)).map(|c| c.ids),
    };
    let asked = match prompt.map_err(|e| bad(format!("{e:#}"))).and_then(|ids| asked(&p, ids, &req.sampling)) {
        Ok(a) => a,
        Err(r) => return respond(request, Err(r)),
    };
    let want_ids = req.sampling.return_token_ids.unwrap_or(false);
    let want_logprobs = req.logprobs.unwrap_or(false);
    let id = format!("chatcmpl-{}", unique());
    if req.sampling.stream {
        let head = json!({"id": id, "object": "chat.completion.chunk", "created": now() as u64, "model": req.model});
        return stream(served, request, asked, head, |piece, finish| match finish {
            None => json!({"index": 0, "delta": {"content": piece}, "finish_reason": null}),
            Some(f) => json!({"index": 0, "delta": {}, "finish_reason": f}),
        });
    }
    let (gen, text) = match generate(served, &asked) {
        Ok(x) => x,
        Err(r) => return respond(request, Err(r)),
    };
    let choice = ChatChoice {
        index: 0,
        message: ChatMessage { role: "assistant".into(), content: text },
        finish_reason: Some(finish_reason(gen.finish).into()),
        stop_reason: Some(stop_reason(&gen, &asked)),
        logprobs: want_logprobs.then(|| ChatLogprobs {
            content: gen
                .ids
                .iter()
                .zip(&gen.logprobs)
                .map(|(&id, &lp)| TokenLogprob {
                    token: token_text(&p, id),
                    logprob: lp,
                    id: Some(id),
                    top_logprobs: vec![],
                })
                .collect(),
        }),
        token_ids: want_ids.then(|| gen.ids.clone()),
        prompt_token_ids: want_ids.then(|| asked.prompt.clone()),
    };
    let resp = ChatResponse {
        id,
        object: "chat.completion".into(),
        created: now() as u64,
        model: req.model.clone(),
        choices: vec![choice],
        usage: usage(&asked, &gen),
    };
    respond(request, serde_json::to_value(resp).map_err(Refusal::from))
}

fn completions(served: &Served, request: Request, req: CompletionRequest) -> std::io::Result<()> {
    let p = match served.get(&req.model) {
        Ok(p) => p,
        Err(r) => return respond(request, Err(r)),
    };
    let ids = match &req.prompt {
        Prompt::Ids(ids) => Ok(ids.clone()),
        Prompt::Text(t) => p.encode(t).map_err(|e| bad(format!("{e:#}"))),
    };
    let asked = match ids.and_then(|ids| asked(&p, ids, &req.sampling)) {
        Ok(a) => a,
        Err(r) => return respond(request, Err(r)),
    };
    let id = format!("cmpl-{}", unique());
    if req.sampling.stream {
        let head = json!({"id": id, "object": "text_completion", "created": now() as u64, "model": req.model});
        return stream(
            served,
            request,
            asked,
            head,
            |piece, finish| json!({"index": 0, "text": piece, "finish_reason": finish}),
        );
    }
    let (gen, text) = match generate(served, &asked) {
        Ok(x) => x,
        Err(r) => return respond(request, Err(r)),
    };
    let want_ids = req.sampling.return_token_ids.unwrap_or(false);
    let choice = CompletionChoice {
        index: 0,
        text,
        finish_reason: Some(finish_reason(gen.finish).into()),
        stop_reason: Some(stop_reason(&gen, &asked)),
        logprobs: req.logprobs.map(|_| CompletionLogprobs {
            tokens: gen.ids.iter().map(|&id| token_text(&p, id)).collect(),
            token_logprobs: gen.logprobs.clone(),
            content: vec![],
        }),
        token_ids: want_ids.then(|| gen.ids.clone()),
        prompt_token_ids: want_ids.then(|| asked.prompt.clone()),
    };
    let resp = CompletionResponse {
        id,
        object: "text_completion".into(),
        created: now() as u64,
        model: req.model.clone(),
        choices: vec![choice],
        usage: usage(&asked, &gen),
    };
    respond(request, serde_json::to_value(resp).map_err(Refusal::from))
}

/// `/v1/load_lora_adapter`: the adapter on the base weights, served under `lora_name`.
fn load_lora(served: &Served, req: LoadLora) -> Result<Value, Refusal> {
    let exists = served.models.read().expect("models lock").iter().skip(1).any(|(n, _)| *n == req.lora_name);
    if exists && !req.load_inplace {
        return Err(bad(format!(
            "The lora adapter '{}' has already been loaded (load_inplace replaces it).",
            req.lora_name
        )));
    }
    let dir = Path::new(&req.lora_path);
    if !lora::is_adapter_dir(dir) {
        return Err(bad(format!("{}: not a PEFT adapter folder (adapter_config.json)", dir.display())));
    }
    let (base_name, base) = served.base();
    if req.lora_name == base_name {
        return Err(bad(format!("`{base_name}` is the base model's name")));
    }
    let adapted = base.reference(true).and_then(|p| p.load_saved(dir)).map_err(|e| bad(format!("{e:#}")))?;
    let mut models = served.models.write().expect("models lock");
    models.retain(|(n, _)| *n != req.lora_name);
    models.push((req.lora_name.clone(), Arc::new(adapted)));
    Ok(json!({"success": true, "message": format!("LoRA adapter '{}' added successfully.", req.lora_name)}))
}

fn unload_lora(served: &Served, name: &str) -> Result<Value, Refusal> {
    let mut models = served.models.write().expect("models lock");
    let before = models.len();
    let base = models[0].0.clone();
    models.retain(|(n, _)| n != name || *n == base);
    if models.len() == before {
        return Err(Refusal(404, format!("The lora adapter '{name}' cannot be found.")));
    }
    Ok(json!({"success": true, "message": format!("LoRA adapter '{name}' removed successfully.")}))
}

/// `/update_weights_from_disk` (SGLang): the base weights replaced by a model folder's; loaded
/// adapters keep the weights they were loaded on. Requests already queued finish on the old ones.
fn update_from_disk(served: &Served, req: UpdateFromDisk) -> Result<Value, Refusal> {
    let policy = load_served(&req.model_path).map_err(|e| bad(format!("{e:#}")))?;
    served.models.write().expect("models lock")[0].1 = Arc::new(policy);
    Ok(json!({"success": true, "message": format!("weights loaded from {}", req.model_path)}))
}

/// Runs one request to the end; returns the generation and its text as the client gets it.
fn generate(served: &Served, asked: &Asked) -> Result<(Generation, String), Refusal> {
    let (tx, rx) = channel();
    let job = Job {
        policy: asked.policy.clone(),
        prompt: asked.prompt.clone(),
        cfg: asked.cfg.clone(),
        seed: asked.seed,
        tokens: None,
        reply: tx,
    };
    served.jobs.send(job).map_err(|_| Refusal(503, "the generation thread has stopped".into()))?;
    let gen = rx
        .recv()
        .map_err(|_| Refusal(503, "the generation thread has stopped".into()))?
        .map_err(|e| Refusal(500, e))?;
    let text = client_text(&gen, asked);
    Ok((gen, text))
}

/// The text as OpenAI returns it: without the stop string that ended it, unless
/// `include_stop_str_in_output`.
fn client_text(gen: &Generation, asked: &Asked) -> String {
    if gen.finish == Finish::Stop && !asked.keep_stop {
        if let Some(s) = asked.stops.iter().find(|s| gen.text.ends_with(s.as_str())) {
            return gen.text[..gen.text.len() - s.len()].to_string();
        }
    }
    gen.text.clone()
}

/// Streams a request as server-sent events (`data: {chunk}` … `data: [DONE]`). The text is
/// sent as it forms, holding back as many bytes as the longest stop string so a stop string is
/// never sent and then taken back.
fn stream(
    served: &Served,
    request: Request,
    asked: Asked,
    head: Value,
    choice: impl Fn(&str, Option<&str>) -> Value,
) -> std::io::Result<()> {
    let (tokens_tx, tokens_rx) = channel();
    let (tx, rx) = channel();
    let job = Job {
        policy: asked.policy.clone(),
        prompt: asked.prompt.clone(),
        cfg: asked.cfg.clone(),
        seed: asked.seed,
        tokens: Some(tokens_tx),
        reply: tx,
    };
    if served.jobs.send(job).is_err() {
        return respond(request, Err(Refusal(503, "the generation thread has stopped".into())));
    }
    // tiny_http buffers a streamed body until it has 8 KB: write the events ourselves, each as
    // one chunk of a chunked body, so each reaches the client as soon as it is formed.
    let mut w = request.into_writer();
    w.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n",
    )?;
    let send = |data: &str, w: &mut Box<dyn Write + Send>| -> std::io::Result<()> {
        write!(w, "{:x}\r\n{data}\r\n", data.len())?;
        w.flush()
    };
    let event = |c: Value, w: &mut Box<dyn Write + Send>| -> std::io::Result<()> {
        let mut v = head.clone();
        v["choices"] = json!([c]);
        send(&format!("data: {v}\n\n"), w)
    };
    if head["object"] == "chat.completion.chunk" {
        event(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}), &mut w)?;
    }
    let hold = asked.stops.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut decoder = asked.policy.tokenizer.decode_stream(true);
    let (mut text, mut sent) = (String::new(), 0);
    for id in tokens_rx {
        if let Ok(Some(piece)) = decoder.step(id) {
            text.push_str(&piece);
            let mut upto = text.len().saturating_sub(hold);
            while !text.is_char_boundary(upto) {
                upto -= 1;
            }
            if upto > sent {
                event(choice(&text[sent..upto], None), &mut w)?;
                sent = upto;
            }
        }
    }
    let gen = match rx.recv() {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => {
            send(&format!("data: {}\n\n", error_body(&e, "InternalServerError", 500)), &mut w)?;
            return send("", &mut w);
        }
        Err(_) => return send("", &mut w),
    };
    let last = client_text(&gen, &asked);
    if let Some(rest) = last.get(sent..).filter(|r| !r.is_empty() && last.starts_with(&text[..sent])) {
        event(choice(rest, None), &mut w)?;
    }
    event(choice("", Some(finish_reason(gen.finish))), &mut w)?;
    send("data: [DONE]\n\n", &mut w)?;
    send("", &mut w) // the last, empty chunk ends the body
}

fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Eos | Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

/// vLLM's `stop_reason`: the stop string that ended the reply, the end-of-sequence id, or null.
fn stop_reason(gen: &Generation, asked: &Asked) -> Value {
    match gen.finish {
        Finish::Stop => asked.stops.iter().find(|s| gen.text.ends_with(s.as_str())).map_or(Value::Null, |s| json!(s)),
        Finish::Eos => gen.ids.last().map_or(Value::Null, |&id| json!(id)),
        Finish::Length => Value::Null,
    }
}

fn usage(asked: &Asked, gen: &Generation) -> Usage {
    Usage {
        prompt_tokens: asked.prompt.len(),
        completion_tokens: gen.ids.len(),
        total_tokens: asked.prompt.len() + gen.ids.len(),
    }
}

fn token_text(p: &Policy, id: u32) -> String {
    p.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// A request id unique within the process.
fn unique() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!("{:x}{:04x}", now() as u64, NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

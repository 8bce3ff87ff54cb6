//! The OpenAI-compatible wire format both sides of `eval` and `serve` speak: chat completions
//! and (legacy) completions, with the extensions the inference engines added and RL needs.
//!
//! Extensions (vLLM's names, which SGLang and llama-server follow where they have them):
//! `top_k`, `continue_final_message` + `add_generation_prompt` (the last assistant message is
//! a prefix to continue, e.g. `<answer>`), `include_stop_str_in_output`, `return_token_ids`
//! (`prompt_token_ids` and `token_ids` on the choice), and a completions `prompt` given as ids.
//! Fields a server does not know are ignored by ours; strict APIs may refuse them (`eval
//! --plain-api` sends none).
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Sampling fields shared by both request kinds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Extension; 0 or -1 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Extension: drop tokens below this share of the top token's probability (llama-server
    /// samples with 0.05 unless told 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    /// Extension: keep the matched stop string at the end of the text (vLLM; default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_stop_str_in_output: Option<bool>,
    /// Extension: `prompt_token_ids` and `token_ids` on each choice (vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_token_ids: Option<bool>,
    /// Extension of `ragen-lab serve` (other engines ignore it): constrain the answer to the
    /// env's action names, as `rollout.constrain_actions` does in process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_grammar: Option<AnswerSpec>,
}

/// `answer_grammar`: at most `max_actions` of `actions`, `A || B`, then `</answer>`; with
/// `starts_inside` false the answer begins after the first `<answer>` the model writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AnswerSpec {
    pub actions: Vec<String>,
    pub max_actions: usize,
    pub starts_inside: bool,
}

/// `POST /v1/load_lora_adapter` (vLLM; SGLang's `/load_lora_adapter` takes the same body): a
/// PEFT adapter folder, then requested by `lora_name` as the `model`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadLora {
    pub lora_name: String,
    pub lora_path: String,
    /// Replace an adapter already loaded under this name (vLLM `load_inplace`).
    #[serde(default)]
    pub load_inplace: bool,
}

/// `POST /update_weights_from_disk` (SGLang): replace the served weights with a model folder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UpdateFromDisk {
    pub model_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn strings(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Return each sampled token's log-prob (`choices[].logprobs.content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// Extension: continue the last (assistant) message instead of opening a new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continue_final_message: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
}

/// A completions `prompt`: text, or token ids (no re-tokenisation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Log-probs of the sampled tokens (`choices[].logprobs.token_logprobs`); the number of
    /// alternatives is not supported beyond 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// One sampled token's log-prob, chat shape (llama-server adds `id`, as we do).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u32>,
    #[serde(default)]
    pub top_logprobs: Vec<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessage,
    pub finish_reason: Option<String>,
    /// Extension (vLLM): the stop string that ended the reply, or null / a token id for an
    /// end-of-sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChatLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(default)]
    pub usage: Usage,
}

/// Completions log-probs: the legacy shape (vLLM, OpenAI, `serve`), or llama-server's, which
/// answers `/v1/completions` in the chat shape with ids (`content: [{id, token, logprob}]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    #[serde(default)]
    pub tokens: Vec<String>,
    #[serde(default)]
    pub token_logprobs: Vec<f32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content: Vec<TokenLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub finish_reason: Option<String>,
    /// Extension (vLLM): the stop string that ended the reply, or null / a token id for an
    /// end-of-sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<CompletionLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default)]
    pub usage: Usage,
}

/// `{"error": {"message", "type", "code"}}`, as OpenAI and vLLM answer a refused request.
pub fn error_body(message: &str, kind: &str, code: u16) -> serde_json::Value {
    serde_json::json!({ "error": { "message": message, "type": kind, "code": code } })
}

/// Servers that drop the stop string from the text (OpenAI, llama-server) leave an answer
/// open: close it with `stop` when the reply ended on it. vLLM and `ragen-lab serve` say so
/// (`stop_reason`, and keep the text with `include_stop_str_in_output`); elsewhere a reply that
/// stopped without the string is taken to have ended on it (an end-of-sequence right after an
/// unclosed answer is closed too).
pub fn restore_stop(text: String, finish: Option<&str>, stop_reason: Option<&serde_json::Value>, stop: &str) -> String {
    let ended_on_stop = match stop_reason {
        Some(serde_json::Value::String(s)) => s == stop,
        Some(_) => false,
        None => finish == Some("stop"),
    };
    if ended_on_stop && !text.ends_with(stop) {
        return format!("{text}{stop}");
    }
    text
}

#[cfg(test)]
mod stop_tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn a_stripped_stop_string_is_put_back() {
        let close = json!("</answer>");
        let put_back = |text: &str, finish, reason| restore_stop(text.into(), finish, reason, "</answer>");
        assert_eq!(put_back("Up || Left", Some("stop"), None), "Up || Left</answer>");
        assert_eq!(put_back("Up || Left", Some("stop"), Some(&close)), "Up || Left</answer>");
        assert_eq!(put_back("Up</answer>", Some("stop"), Some(&close)), "Up</answer>");
        // An end-of-sequence the server names (a token id, or null) is not a closed answer.
        assert_eq!(put_back("Up", Some("stop"), Some(&Value::Null)), "Up");
        assert_eq!(put_back("Up Up Up", Some("length"), None), "Up Up Up");
    }
}

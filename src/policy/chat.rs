//! Chat templates: render system/user/assistant messages with the model's own Jinja template
//! (minijinja, configured like transformers' sandbox: trim_blocks, lstrip_blocks, `raise_exception`,
//! a few Python string methods) and tokenize them with the loss mask over assistant tokens.
//!
//! The mask is found by rendering prefixes of the conversation: assistant message k's text is
//! what `render(msgs[..=k])` adds after `render(msgs[..k], add_generation_prompt)`, cut after
//! its end-of-turn token (`<|im_end|>`, `<|eot_id|>`). So the role header is never in the mask,
//! the content and the closing token are, and any template that renders prefixes stably works.
use anyhow::{anyhow, bail, Result};
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

/// ChatML as Qwen2.5 and SmolLM2 use it (without their default system prompts).
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Llama-3's format (without the tool-calling and date parts of 3.1+).
pub const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Tokens that close a turn in the formats we know; the first one found ends the loss mask.
pub const END_OF_TURN: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>"];

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// A byte range of `content` the model did not write (text the sampler forced, such as
    /// `</think><answer>` after the think budget): in the chat, but out of the loss mask.
    #[serde(skip)]
    pub unscored: Option<(usize, usize)>,
    /// The token ids `content` was sampled as (a reply kept as written): the chat holds exactly
    /// these where the content stands, not a re-tokenization of its text, which need not give
    /// the same ids (decode → encode does not round-trip).
    #[serde(skip)]
    pub ids: Option<Vec<u32>>,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.to_string(), content: content.into(), unscored: None, ids: None }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Token ids of a rendered conversation and, per token, whether it is an assistant token, and
/// whether it is scored (an assistant token outside the messages' `unscored` ranges).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTokens {
    pub ids: Vec<u32>,
    pub assistant_mask: Vec<bool>,
    pub scored: Vec<bool>,
}

/// Byte spans of a rendered chat: assistant turns, their unscored ranges, and the contents that
/// stand as sampled ids.
struct Spans<'m> {
    assistant: Vec<(usize, usize)>,
    unscored: Vec<(usize, usize)>,
    verbatim: Vec<(usize, usize, &'m [u32])>,
}

/// A chat template with the special-token strings it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

/// Python `str` methods that HF templates call (`content.strip()`, `role.startswith('…')`).
fn python_methods(_: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let s = value.as_str().ok_or_else(|| Error::from(ErrorKind::UnknownMethod))?;
    let arg = |i: usize| args.get(i).and_then(Value::as_str).unwrap_or_default().to_string();
    Ok(match method {
        "strip" => Value::from(s.trim()),
        "lstrip" => Value::from(s.trim_start()),
        "rstrip" => Value::from(s.trim_end()),
        "lower" => Value::from(s.to_lowercase()),
        "upper" => Value::from(s.to_uppercase()),
        "startswith" => Value::from(s.starts_with(&arg(0))),
        "endswith" => Value::from(s.ends_with(&arg(0))),
        "split" if !args.is_empty() => Value::from(s.split(&arg(0)).map(str::to_string).collect::<Vec<_>>()),
        "split" => Value::from(s.split_whitespace().map(str::to_string).collect::<Vec<_>>()),
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

impl ChatTemplate {
    pub fn new(source: impl Into<String>, bos_token: impl Into<String>, eos_token: impl Into<String>) -> Result<Self> {
        let t = Self { source: source.into(), bos_token: bos_token.into(), eos_token: eos_token.into() };
        t.render(&[Message::user("check")], true).map_err(|e| anyhow!("the chat template does not render: {e:#}"))?;
        Ok(t)
    }

    /// The conversation as text, as `tokenizer.apply_chat_template(tokenize=False)` gives it.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.set_unknown_method_callback(python_methods);
        let tmpl = env.template_from_str(&self.source).map_err(|e| anyhow!("chat template: {e:#}"))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        tmpl.render(ctx).map_err(|e| anyhow!("chat template: {e:#}"))
    }

    /// Byte spans of the rendered text that belong to assistant turns (see the module doc), the
    /// spans of their `unscored` ranges, and where the messages with sampled `ids` stand.
    fn assistant_spans<'m>(&self, messages: &'m [Message], full: &str) -> Result<Spans<'m>> {
        let mut unscored = vec![];
        let mut spans = vec![];
        let mut verbatim = vec![];
        for (k, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let before = self.render(&messages[..k], true)?;
            let upto = self.render(&messages[..=k], false)?;
            if !upto.starts_with(&before) || !full.starts_with(&upto) {
                bail!("the chat template does not render conversation prefixes stably, so the assistant mask of message {k} cannot be found");
            }
            let turn = &upto[before.len()..];
            let end = END_OF_TURN.iter().filter_map(|e| turn.find(e).map(|i| i + e.len())).min().unwrap_or(turn.len());
            spans.push((before.len(), before.len() + end));
            if let Some((a, b)) = m.unscored {
                // Where the content sits in the turn (a template may trim around it).
                let Some(at) = m.content.get(a..b).and_then(|forced| turn.find(forced)) else {
                    bail!("assistant message {k}: its unscored range is not in the rendered turn");
                };
                unscored.push((before.len() + at, before.len() + at + (b - a)));
            }
            // A template that rewrites the content (trims it) leaves it to the text.
            if let (Some(ids), Some(at)) = (&m.ids, turn.find(&m.content)) {
                verbatim.push((before.len() + at, before.len() + at + m.content.len(), ids.as_slice()));
            }
        }
        Ok(Spans { assistant: spans, unscored, verbatim })
    }

    /// Render and tokenize. The template writes any BOS itself, so the tokenizer adds none
    /// (no doubled BOS).
    /// Messages with sampled `ids` keep them: the text around them is tokenized piece by piece.
    pub fn tokens(&self, tok: &Tokenizer, messages: &[Message], add_generation_prompt: bool) -> Result<ChatTokens> {
        let text = self.render(messages, add_generation_prompt)?;
        let spans = self.assistant_spans(messages, &text)?;
        // Each token's id and the byte where its text starts.
        let (mut ids, mut starts) = (Vec::new(), Vec::new());
        let mut at = 0;
        for &(a, b, kept) in spans.verbatim.iter().chain([&(text.len(), text.len(), &[][..])]) {
            let enc = tok.encode(&text[at..a], false).map_err(|e| anyhow!("tokenizing the chat: {e}"))?;
            ids.extend(enc.get_ids());
            starts.extend(enc.get_offsets().iter().map(|&(s, _)| at + s));
            ids.extend(kept);
            starts.extend(std::iter::repeat_n(a, kept.len()));
            at = b;
        }
        let within = |spans: &[(usize, usize)], start: usize| spans.iter().any(|&(s, e)| start >= s && start < e);
        let assistant_mask: Vec<bool> = starts.iter().map(|&start| within(&spans.assistant, start)).collect();
        let scored =
            starts.iter().zip(&assistant_mask).map(|(&start, &a)| a && !within(&spans.unscored, start)).collect();
        Ok(ChatTokens { ids, assistant_mask, scored })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tokenizer::train_bpe;
    use super::*;

    fn conversation() -> Vec<Message> {
        vec![
            Message::system("You are a helpful assistant."),
            Message::user("Go Up or Down?"),
            Message::assistant("<think>Up</think><answer>Up</answer>"),
            Message::user("Reward:\n1"),
            Message::assistant("<answer>Down</answer>"),
        ]
    }

    /// The masked tokens decode to exactly the assistant contents, each with its end-of-turn token.
    fn check_mask(template: &str, specials: &[&str], bos: &str, eot: &str) {
        let tok = train_bpe(
            &["Go Up or Down? <think>Up</think><answer>Down</answer> assistant user system"],
            400,
            specials,
            &[],
        )
        .unwrap();
        let t = ChatTemplate::new(template, bos, eot).unwrap();
        let ct = t.tokens(&tok, &conversation(), false).unwrap();
        assert_eq!(ct.ids.len(), ct.assistant_mask.len());
        let masked: Vec<u32> = ct.ids.iter().zip(&ct.assistant_mask).filter(|(_, &m)| m).map(|(&i, _)| i).collect();
        let text = tok.decode(&masked, false).unwrap();
        assert_eq!(text, format!("<think>Up</think><answer>Up</answer>{eot}<answer>Down</answer>{eot}"));
        let bos_id = tok.token_to_id(bos);
        assert!(bos_id.is_none() || ct.ids.iter().filter(|&&i| Some(i) == bos_id).count() == 1, "one BOS");
    }

    #[test]
    fn an_unscored_range_stays_in_the_turn_but_leaves_the_loss_mask() {
        let tok = train_bpe(
            &["Go Up or Down? <think>Up</think><answer>Down</answer>"],
            400,
            &["<|im_start|>", "<|im_end|>"],
            &["</think>", "<answer>"],
        )
        .unwrap();
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let content = "<think>Up</think><answer>Up</answer>";
        let forced = content.find("</think>").unwrap();
        let mut reply = Message::assistant(content);
        reply.unscored = Some((forced, forced + "</think><answer>".len()));
        let ct = t.tokens(&tok, &[Message::user("Go Up or Down?"), reply], false).unwrap();
        let pick = |mask: &[bool]| {
            let ids: Vec<u32> = ct.ids.iter().zip(mask).filter(|(_, &m)| m).map(|(&i, _)| i).collect();
            tok.decode(&ids, false).unwrap()
        };
        assert_eq!(pick(&ct.assistant_mask), format!("{content}<|im_end|>"));
        assert_eq!(pick(&ct.scored), "<think>UpUp</answer><|im_end|>");
    }

    #[test]
    fn a_reply_with_sampled_ids_keeps_them_and_the_rest_is_tokenized_as_text() {
        let tok = train_bpe(
            &["Go Up or Down? Upward Upward Upward Up Up ward ward ward"],
            400,
            &["<|im_start|>", "<|im_end|>"],
            &[],
        )
        .unwrap();
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let id = |s: &str| tok.token_to_id(s).unwrap();
        // "Upward" sampled letter by letter at first, which re-tokenizing its text would not give.
        let sampled = vec![id("U"), id("p"), id("ward")];
        assert_ne!(tok.encode("Upward", false).unwrap().get_ids(), &sampled[..]);
        let mut reply = Message::assistant("Upward");
        reply.ids = Some(sampled.clone());
        let msgs = [Message::user("Go Up or Down?"), reply, Message::user("Up")];
        let ct = t.tokens(&tok, &msgs, true).unwrap();
        let prompt = t.tokens(&tok, &msgs[..1], true).unwrap();
        // The chat up to the reply is the prompt it was sampled after, then the sampled ids.
        assert_eq!(&ct.ids[..prompt.ids.len()], &prompt.ids[..]);
        let at = prompt.ids.len();
        assert_eq!(&ct.ids[at..at + 3], &sampled[..]);
        assert_eq!(tok.decode(&ct.ids, false).unwrap(), t.render(&msgs, true).unwrap());
        let masked: Vec<u32> = ct.ids.iter().zip(&ct.scored).filter(|(_, &m)| m).map(|(&i, _)| i).collect();
        assert_eq!(masked, [id("U"), id("p"), id("ward"), id("<|im_end|>")]);
    }

    #[test]
    fn chatml_mask_covers_assistant_content_and_im_end_only() {
        check_mask(CHATML, &["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "", "<|im_end|>");
    }

    #[test]
    fn llama3_mask_and_single_bos() {
        let specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"];
        check_mask(LLAMA3, &specials, "<|begin_of_text|>", "<|eot_id|>");
    }

    #[test]
    fn generation_prompt_ends_with_the_assistant_header() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let s = t.render(&[Message::user("hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_and_python_methods_work() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'].strip() }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(t.render(&[Message::user("  x ")], false).unwrap(), "x");
        let err = t.render(&[Message::system("s")], false).unwrap_err();
        assert!(format!("{err:#}").contains("first must be user"), "{err:#}");
    }
}

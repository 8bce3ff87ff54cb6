//! The policy on the tiny presets, through the real loaders: the two forward paths agree,
//! gradients reach every weight and match finite differences, an AdamW step lowers the loss,
//! batched generation equals one-at-a-time generation, HF/GGUF/save round trips, the critic,
//! and the `model` CLI's public JSON.
use std::collections::HashMap;
use std::process::Command;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use ragen_lab::policy::model::{KvCache, Mode};
use ragen_lab::policy::{
    preset, Critic, Finish, GenerationConfig, Message, ModelLocation, Policy, Temperature, TokenBatch,
};
use ragen_lab::rng::Rng;

const PRESETS: [&str; 2] = ["tiny-llama", "tiny-qwen2"];

fn load(name: &str) -> Policy {
    Policy::load(name, &Device::Cpu).unwrap()
}

fn chat(p: &Policy, user: &str) -> Vec<u32> {
    let m = [Message::system("You are playing a game."), Message::user(user)];
    p.chat_tokens(&m, true).unwrap().ids
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// Σ over scored positions of the taken tokens' log-probs.
fn total_logprob(p: &Policy, batch: &TokenBatch) -> Tensor {
    p.token_logprobs(batch).unwrap().logprobs.sum_all().unwrap()
}

fn batch(p: &Policy) -> TokenBatch {
    let a = chat(p, "Go Up or Down?");
    let b = chat(p, "Which is bigger, 3 or 7? Answer in <answer></answer>.");
    TokenBatch::new(&[a, b], p.pad_id).unwrap()
}

#[test]
fn training_path_and_cached_sampling_path_give_the_same_logits() {
    for name in PRESETS {
        let p = load(name);
        let ids = chat(&p, "Dragon or Phoenix?");
        let t = ids.len();
        let x = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let h = p.model.hidden(&x, &[0], None, Mode::Train).unwrap().squeeze(0).unwrap();
        let train = p.model.logits(&h).unwrap(); // [T, V]
                                                 // Sampling path: prefill half, then one token at a time through the KV cache.
        let mut cache = KvCache::new(&p.model.cfg, 1, t, &Device::Cpu).unwrap();
        let half = t / 2;
        let mut rows = vec![];
        let pre = x.narrow(1, 0, half).unwrap();
        rows.push(p.model.hidden(&pre, &[0], Some(&mut cache), Mode::Sample).unwrap().squeeze(0).unwrap());
        for i in half..t {
            let step = x.narrow(1, i, 1).unwrap();
            rows.push(p.model.hidden(&step, &[0], Some(&mut cache), Mode::Sample).unwrap().squeeze(0).unwrap());
        }
        let sample = p.model.logits(&Tensor::cat(&rows, 0).unwrap()).unwrap();
        let d = max_abs_diff(&train, &sample);
        assert!(d <= 1e-4, "{name}: train vs sample logits differ by {d}");
    }
}

#[test]
fn every_weight_gets_a_nonzero_gradient() {
    for name in PRESETS {
        let p = load(name);
        let grads = total_logprob(&p, &batch(&p)).backward().unwrap();
        for (n, v) in p.model.named_vars() {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient for {n}"));
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{name}: gradient of {n} has norm² {norm}");
        }
    }
}

fn nudge(v: &Var, idx: usize, delta: f32) {
    let shape = v.as_tensor().shape().clone();
    let mut data = v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    data[idx] += delta;
    v.set(&Tensor::from_vec(data, shape, &Device::Cpu).unwrap()).unwrap();
}

#[test]
fn gradients_match_finite_differences() {
    for name in PRESETS {
        let p = load(name);
        let b = batch(&p);
        let loss = |p: &Policy| (total_logprob(p, &b) / 100.0).unwrap();
        let grads = loss(&p).backward().unwrap();
        let vars: HashMap<String, Var> = p.model.named_vars().into_iter().collect();
        let mut checked = vec![
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.input_layernorm.weight",
            "model.norm.weight",
        ];
        if name == "tiny-qwen2" {
            checked.extend(["model.layers.0.self_attn.v_proj.bias", "lm_head.weight"]);
        }
        for n in checked {
            let v = &vars[n];
            let g = grads.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // The entry with the largest gradient: well above f32 round-off.
            let idx = (0..g.len()).fold(0, |b, i| if g[i].abs() > g[b].abs() { i } else { b });
            let eps = 1e-2;
            nudge(v, idx, eps);
            let up = loss(&p).to_scalar::<f32>().unwrap();
            nudge(v, idx, -2.0 * eps);
            let down = loss(&p).to_scalar::<f32>().unwrap();
            nudge(v, idx, eps);
            let fd = (up - down) / (2.0 * eps);
            assert!(
                (fd - g[idx]).abs() <= 0.02 * g[idx].abs() + 2e-4,
                "{name} {n}[{idx}]: backward {} vs finite difference {fd}",
                g[idx]
            );
        }
    }
}

#[test]
fn one_adamw_step_lowers_the_loss() {
    let p = load("tiny-qwen2");
    let b = batch(&p);
    let loss = |p: &Policy| total_logprob(p, &b).neg().unwrap();
    let before = loss(&p);
    let mut opt = candle_nn::AdamW::new_lr(p.vars(), 1e-2).unwrap();
    opt.backward_step(&before).unwrap();
    let (before, after) = (before.to_scalar::<f32>().unwrap(), loss(&p).to_scalar::<f32>().unwrap());
    assert!(after < before - 1.0, "loss {before} → {after}");
}

#[test]
fn micro_batch_gradients_sum_to_the_full_batch_gradient() {
    let p = load("tiny-llama");
    let mut seqs = vec![chat(&p, "Up"), chat(&p, "Go Left or Right, then Down?"), chat(&p, "3 or 7?")];
    seqs.push(seqs[0][..5].to_vec());
    let full = TokenBatch::new(&seqs, p.pad_id).unwrap();
    let vars = p.vars();
    let whole = total_logprob(&p, &full).backward().unwrap();
    // The trainer's path: each micro-batch's gradients added into one store.
    let mut acc = GradStore::default();
    for mb in full.split(2) {
        p.loss_and_grads(&mb, |s| Ok(s.logprobs.sum_all()?), &mut acc).unwrap();
    }
    for v in &vars {
        let d = max_abs_diff(whole.get(v.as_tensor()).unwrap(), acc.get(v.as_tensor()).unwrap());
        assert!(d < 1e-4, "micro-batched gradient differs by {d}");
    }
    let no_grad = p.token_logprobs_no_grad(&full).unwrap();
    let with = p.token_logprobs(&full).unwrap();
    assert_eq!(max_abs_diff(&no_grad.logprobs, &with.logprobs), 0.0);
    assert_eq!(max_abs_diff(&no_grad.entropy, &with.entropy), 0.0);
    let lp = with.logprobs.to_vec2::<f32>().unwrap();
    assert_eq!(lp[3][0], 0.0, "position 0 is not scored");
    assert_eq!(lp[3][6], 0.0, "padding is not scored");
    assert!(lp[3][4] < 0.0);
}

#[test]
fn chunked_loss_and_grads_equal_plain_backward() {
    for name in PRESETS {
        let mut p = load(name);
        p.logit_chunk = 3 * p.model.cfg.vocab_size * 2; // 3 positions per chunk for 2 rows: many chunks
        let b = batch(&p);
        // A loss that is not linear in the scores, like PPO's.
        let loss = |s: &ragen_lab::policy::Scored| -> anyhow::Result<Tensor> {
            Ok((s.logprobs.exp()?.sum_all()? + (s.entropy.sqr()?.sum_all()? * 0.1)?)?)
        };
        let direct_loss = loss(&p.token_logprobs(&b).unwrap()).unwrap();
        let direct = direct_loss.backward().unwrap();
        let mut chunked = GradStore::default();
        let value = p.loss_and_grads(&b, loss, &mut chunked).unwrap();
        assert!((value - direct_loss.to_scalar::<f32>().unwrap()).abs() < 1e-4);
        for (n, v) in p.model.named_vars() {
            let (a, c) = (direct.get(v.as_tensor()).unwrap(), chunked.get(v.as_tensor()).unwrap());
            let d = max_abs_diff(a, c);
            assert!(d < 1e-5, "{name} {n}: chunked gradient differs by {d}");
        }
    }
}

#[test]
fn batched_greedy_generation_equals_one_at_a_time_despite_padding() {
    for name in PRESETS {
        let p = load(name);
        let prompts =
            vec![chat(&p, "Up"), chat(&p, "Which is bigger, 3 or 7? Answer in <answer></answer>."), chat(&p, "Go")];
        let cfg = GenerationConfig { max_new_tokens: 12, temperature: 0.0, ..Default::default() };
        let batched = p.generate(&prompts, &cfg, &mut Rng::new(0)).unwrap();
        let same_as_alone = |batched: &[ragen_lab::policy::Generation], cfg: &GenerationConfig| {
            for (i, prompt) in prompts.iter().enumerate() {
                let single = p.generate(std::slice::from_ref(prompt), cfg, &mut Rng::new(0)).unwrap().remove(0);
                assert_eq!(batched[i].ids, single.ids, "{name} row {i}");
                assert_eq!(batched[i].text, single.text);
                assert_eq!(batched[i].finish, single.finish);
                for (a, b) in batched[i].logprobs.iter().zip(&single.logprobs) {
                    assert!((a - b).abs() < 1e-4, "{name} row {i}: log-prob {a} vs {b}");
                }
            }
        };
        same_as_alone(&batched, &cfg);
        // One row stops early on a string from its own text: it leaves the batch (the KV cache
        // is compacted) and the others carry on exactly as alone.
        let stop: String = batched[1].text.chars().skip(1).find(char::is_ascii_alphanumeric).expect("a letter").into();
        let cfg = GenerationConfig { stop_strings: vec![stop], ..cfg };
        let batched = p.generate(&prompts, &cfg, &mut Rng::new(0)).unwrap();
        assert_eq!(batched[1].finish, Finish::Stop);
        same_as_alone(&batched, &cfg);
    }
}

/// Constrained answers: whatever a random model prefers, every sampled answer is one of the
/// action names, then `</answer>`; the think budget forces `</think><answer>` after N tokens,
/// after which the constraint governs the answer.
#[test]
fn constrained_answers_name_only_actions_and_the_think_budget_forces_the_close() {
    use ragen_lab::policy::constrain::AnswerGrammar;
    use ragen_lab::policy::sample::Forcing;
    let p = load("tiny-llama");
    let actions: Vec<String> = ["Walrus", "Quokka"].map(String::from).to_vec();
    let prompts = vec![chat(&p, "Walrus or Quokka?"); 6];
    let cfg = GenerationConfig {
        max_new_tokens: 16,
        temperature: 1.0,
        stop_strings: vec!["</answer>".into()],
        constraint: AnswerGrammar::new(&actions, 1, true),
        ..Default::default()
    };
    let mut seen = std::collections::HashSet::new();
    for g in p.generate(&prompts, &cfg, &mut Rng::new(3)).unwrap() {
        assert!(!g.forced);
        if g.finish == Finish::Stop {
            let answer = g.text.trim_end_matches("</answer>").trim();
            assert!(actions.iter().any(|a| a == answer), "{:?}", g.text);
            seen.insert(answer.to_string());
        } else {
            assert!(AnswerGrammar::new(&actions, 1, true).unwrap().allows("", &g.text), "{:?}", g.text);
        }
    }
    assert!(!seen.is_empty());
    // Think mode: free text for 4 tokens, then the forced close, then a constrained answer.
    let forced = p.encode_plain("</think><answer>").unwrap();
    let cfg = GenerationConfig {
        max_new_tokens: 24,
        constraint: AnswerGrammar::new(&actions, 1, false),
        forcing: Some(Forcing { after: 4, unless: "</think>".into(), ids: forced.clone() }),
        ..cfg
    };
    let mut forced_rows = 0;
    for g in p.generate(&prompts, &cfg, &mut Rng::new(4)).unwrap() {
        if !g.forced {
            // It ended or closed the think block itself within the budget.
            assert!(g.ids.len() <= 4 || g.text.contains("</think>"), "{:?}", g.text);
            continue;
        }
        forced_rows += 1;
        let at = g.ids.windows(forced.len()).position(|w| w == forced.as_slice()).expect("the forced ids");
        assert_eq!(at, 4, "{:?}", g.text);
        assert!(g.logprobs[at..at + forced.len()].iter().all(|&lp| lp == 0.0));
        let answer = g.text.split("<answer>").nth(1).unwrap();
        assert!(AnswerGrammar::new(&actions, 1, true).unwrap().allows("", answer), "{:?}", g.text);
    }
    assert!(forced_rows > 0);
}

#[test]
fn sampling_is_seeded_and_rows_stop_on_their_own() {
    let p = load("tiny-llama");
    let prompts = vec![chat(&p, "Up"), chat(&p, "Down")];
    let cfg = GenerationConfig { max_new_tokens: 10, temperature: 1.0, top_p: 0.9, top_k: 50, ..Default::default() };
    let a = p.generate(&prompts, &cfg, &mut Rng::new(7)).unwrap();
    let b = p.generate(&prompts, &cfg, &mut Rng::new(7)).unwrap();
    let c = p.generate(&prompts, &cfg, &mut Rng::new(8)).unwrap();
    assert_eq!(a, b);
    assert_ne!(a.iter().map(|g| &g.ids).collect::<Vec<_>>(), c.iter().map(|g| &g.ids).collect::<Vec<_>>());
    for g in &a {
        let ended = g.ids.last().is_some_and(|id| p.stop_ids.contains(id));
        assert!(g.finish == Finish::Length && g.ids.len() == 10 || g.finish == Finish::Eos && ended, "{g:?}");
        assert_eq!(g.logprobs.len(), g.ids.len());
        assert!(g.logprobs.iter().all(|&x| x <= 0.0 && x.is_finite()));
    }

    // A stop string taken from the sampled text itself ends that row there; the other row runs on.
    let row0 = &a[0];
    let stop: String =
        row0.text.chars().skip(1).find(char::is_ascii_alphanumeric).expect("a letter in the text").into();
    let with_stop = GenerationConfig { stop_strings: vec![stop.clone()], ..cfg.clone() };
    let stopped = p.generate(&prompts, &with_stop, &mut Rng::new(7)).unwrap();
    assert_eq!(stopped[0].finish, Finish::Stop, "{:?} / {stop:?}", row0.text);
    assert!(stopped[0].text.ends_with(&stop) && row0.text.starts_with(&stopped[0].text));
    assert!(stopped[0].text.len() < row0.text.len());
    let n = stopped[0].ids.len();
    assert_eq!(stopped[1].ids[..n], a[1].ids[..n], "same draws while both rows run");
    if !stopped[1].text.contains(&stop) && stopped[1].finish != Finish::Eos {
        assert_eq!(stopped[1].ids.len(), 10, "the other row runs to its budget");
    }
}

#[test]
fn a_long_stop_string_stops_where_the_full_text_first_holds_it() {
    let p = load("tiny-llama");
    let prompt = chat(&p, "Dragon or Phoenix?");
    let cfg = GenerationConfig { max_new_tokens: 48, temperature: 1.0, ..Default::default() };
    let free = p.generate(std::slice::from_ref(&prompt), &cfg, &mut Rng::new(3)).unwrap().remove(0);
    let chars: Vec<char> = free.text.chars().collect();
    assert!(chars.len() > 30, "{:?}", free.text);
    // A stop string of a dozen characters from the back half of the reply, many tokens deep.
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 12].iter().collect();
    // The reference: the first prefix of the sampled ids whose full text holds the stop string.
    let expected = (1..=free.ids.len()).find(|&n| p.decode(&free.ids[..n]).unwrap().contains(&stop)).unwrap();
    let cfg = GenerationConfig { stop_strings: vec![stop.clone()], ..cfg };
    let stopped = p.generate(std::slice::from_ref(&prompt), &cfg, &mut Rng::new(3)).unwrap().remove(0);
    assert_eq!(stopped.finish, Finish::Stop);
    assert_eq!(stopped.ids, free.ids[..expected], "stopped at the first token whose text completes {stop:?}");
    assert!(stopped.text.ends_with(&stop));
}

/// After a stop string the sampler scores the template's end-of-turn at the next position (the
/// update trains it there): the log-prob a full forward over the prompt and the reply gives at
/// the text temperature, also for a stop met on the budget's last token.
#[test]
fn a_row_that_stops_on_a_string_scores_the_end_of_turn_after_it() {
    let p = load("tiny-llama");
    let end = p.end_of_turn_id().expect("the template closes a turn with a stop id");
    let prompts = vec![chat(&p, "Dragon or Phoenix?"), chat(&p, "Up or Down?")];
    let cfg = GenerationConfig { max_new_tokens: 24, temperature: 0.7, ..Default::default() };
    let free = p.generate(&prompts, &cfg, &mut Rng::new(5)).unwrap();
    let stop: String = free[0].text.chars().skip(2).find(char::is_ascii_alphanumeric).expect("a letter").into();
    for budget in [24, 0] {
        let with_end = GenerationConfig { stop_strings: vec![stop.clone()], end_after_stop: Some(end), ..cfg.clone() };
        let stopped = p.generate(&prompts, &with_end, &mut Rng::new(5)).unwrap();
        let g = &stopped[0];
        assert_eq!(g.finish, Finish::Stop, "{:?}", free[0].text);
        // Stopped on its last allowed token: one more step scores the end all the same.
        let g = if budget == 0 {
            let last = GenerationConfig { max_new_tokens: g.ids.len(), ..with_end.clone() };
            &p.generate(&prompts[..1], &last, &mut Rng::new(5)).unwrap()[0].clone()
        } else {
            g
        };
        let logits = p.next_token_logits(&[prompts[0].clone(), g.ids.clone()].concat()).unwrap();
        let t = 0.7f32;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let logsum = logits.iter().map(|&z| ((z - max) / t).exp()).sum::<f32>().ln();
        let want = (logits[end as usize] - max) / t - logsum;
        let got = g.end_logprob.expect("scored after the stop");
        assert!((got - want).abs() < 1e-4, "budget {budget}: {got} vs {want}");
        for (row, other) in stopped.iter().enumerate().skip(1) {
            assert_eq!(other.end_logprob.is_some(), other.finish == Finish::Stop, "row {row}");
        }
    }
    // Not asked for: nothing scored.
    let plain = GenerationConfig { stop_strings: vec![stop], ..cfg };
    assert!(p.generate(&prompts, &plain, &mut Rng::new(5)).unwrap().iter().all(|g| g.end_logprob.is_none()));
}

#[test]
fn end_of_turn_token_stops_a_row() {
    let p = load("tiny-qwen2"); // untied lm_head: one row can be edited
    let prompt = chat(&p, "Up");
    let greedy = GenerationConfig { max_new_tokens: 8, temperature: 0.0, ..Default::default() };
    let first = p.generate(std::slice::from_ref(&prompt), &greedy, &mut Rng::new(0)).unwrap()[0].ids[0] as usize;
    // Make <|im_end|>'s output row a scaled copy of the greedy token's row, so it wins.
    let im_end = p.tokenizer.token_to_id("<|im_end|>").unwrap() as usize;
    let head = p.model.lm_head.as_ref().unwrap();
    let mut w = head.as_tensor().to_vec2::<f32>().unwrap();
    w[im_end] = w[first].iter().map(|x| 10.0 * x).collect();
    head.set(&Tensor::new(w, &Device::Cpu).unwrap()).unwrap();
    let g = p.generate(&[prompt], &greedy, &mut Rng::new(0)).unwrap().remove(0);
    assert_eq!(g.finish, Finish::Eos);
    assert_eq!(g.ids, vec![im_end as u32]);
    assert_eq!(g.text, "", "special tokens are not in the text");
}

fn logits_of(p: &Policy, ids: &[u32]) -> Vec<f32> {
    p.next_token_logits(ids).unwrap()
}

#[test]
fn hf_save_sharded_and_gguf_forms_load_back_the_same_model() {
    for name in PRESETS {
        let p = load(name);
        let ids = chat(&p, "Dragon or Phoenix?");
        let want = logits_of(&p, &ids);
        let tmp = tempfile::tempdir().unwrap();

        // save → HF folder → load
        let saved = tmp.path().join("saved");
        p.save(&saved).unwrap();
        let q = Policy::from_location(&ModelLocation::HfDir(saved.clone()), &Device::Cpu).unwrap();
        assert_eq!(logits_of(&q, &ids), want, "{name}: saved model");
        assert_eq!(chat(&q, "Dragon or Phoenix?"), ids);

        // the same weights split over two shards with an index
        let sharded = tmp.path().join("sharded");
        std::fs::create_dir_all(&sharded).unwrap();
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
            std::fs::copy(saved.join(f), sharded.join(f)).unwrap();
        }
        let all = candle_core::safetensors::load(saved.join("model.safetensors"), &Device::Cpu).unwrap();
        let (mut a, mut b, mut map) = (HashMap::new(), HashMap::new(), serde_json::Map::new());
        for (i, (n, t)) in all.into_iter().enumerate() {
            let file = if i % 2 == 0 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
            map.insert(n.clone(), file.into());
            if i % 2 == 0 {
                a.insert(n, t)
            } else {
                b.insert(n, t)
            };
        }
        candle_core::safetensors::save(&a, sharded.join("model-00001-of-00002.safetensors")).unwrap();
        candle_core::safetensors::save(&b, sharded.join("model-00002-of-00002.safetensors")).unwrap();
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let s = Policy::from_location(&ModelLocation::HfDir(sharded), &Device::Cpu).unwrap();
        assert_eq!(logits_of(&s, &ids), want, "{name}: sharded");

        // GGUF (Q/K permuted on write, un-permuted on read; tokenizer and template from metadata)
        let gguf = tmp.path().join(format!("{name}.gguf"));
        preset::write_gguf(name, &gguf).unwrap();
        let g = Policy::from_location(&ModelLocation::Gguf(gguf), &Device::Cpu).unwrap();
        assert_eq!(chat(&g, "Dragon or Phoenix?"), ids, "{name}: GGUF tokenizer + template");
        let got = logits_of(&g, &ids);
        let d = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "{name}: GGUF logits differ by {d}");
        assert_eq!(g.stop_ids, p.stop_ids);
        // RAGEN's tags are whole tokens (GGUF type 4) that still decode as text.
        let tagged = "<answer> Dragon </answer>";
        let enc = |m: &Policy| m.tokenizer.encode(tagged, false).unwrap().get_ids().to_vec();
        assert_eq!(enc(&g), enc(&p), "{name}: GGUF tokenizer on tags");
        let (ids, tag) = (enc(&g), |t: &str| g.tokenizer.token_to_id(t));
        assert_eq!((tag("<answer>"), tag("</answer>")), (Some(ids[0]), ids.last().copied()), "{name}: {ids:?}");
        assert_eq!(g.decode(&enc(&g)).unwrap(), tagged, "{name}: tags decode as text");
    }
}

#[test]
fn loader_errors_name_the_file_and_the_missing_tensor() {
    let p = load("tiny-llama");
    let tmp = tempfile::tempdir().unwrap();
    p.save(tmp.path()).unwrap();
    let path = tmp.path().join("model.safetensors");
    let mut all = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    all.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&all, &path).unwrap();
    let err = Policy::from_location(&ModelLocation::HfDir(tmp.path().into()), &Device::Cpu).err().unwrap();
    let msg = format!("{err:#}");
    assert!(msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("model.safetensors"), "{msg}");

    std::fs::remove_file(&path).unwrap();
    let msg =
        format!("{:#}", Policy::from_location(&ModelLocation::HfDir(tmp.path().into()), &Device::Cpu).err().unwrap());
    assert!(msg.contains("no model.safetensors"), "{msg}");
}

#[test]
fn loaders_refuse_tensors_and_config_fields_the_block_does_not_implement() {
    let p = load("tiny-llama");
    let load_dir = |dir: &std::path::Path| {
        Policy::from_location(&ModelLocation::HfDir(dir.into()), &Device::Cpu).err().map(|e| format!("{e:#}"))
    };
    // An extra tensor (an o_proj bias) would be dropped silently: an error that names it.
    let tmp = tempfile::tempdir().unwrap();
    p.save(tmp.path()).unwrap();
    let path = tmp.path().join("model.safetensors");
    let mut all = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    all.insert(
        "model.layers.0.self_attn.o_proj.bias".into(),
        Tensor::zeros(8, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    // RoPE buffers old checkpoints carry are harmless.
    all.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&all, &path).unwrap();
    let msg = load_dir(tmp.path()).expect("an unused tensor must be an error");
    assert!(msg.contains("model.layers.0.self_attn.o_proj.bias") && !msg.contains("inv_freq"), "{msg}");
    all.remove("model.layers.0.self_attn.o_proj.bias");
    candle_core::safetensors::save(&all, &path).unwrap();
    assert_eq!(load_dir(tmp.path()), None, "inv_freq alone loads");
    // Config fields that change the block's math.
    let cfg_path = tmp.path().join("config.json");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    for (key, value, expect) in [
        ("hidden_act", serde_json::json!("gelu"), "hidden_act \"gelu\""),
        ("mlp_bias", serde_json::json!(true), "mlp_bias = true"),
        ("attention_bias", serde_json::json!(true), "attention_bias = true"),
    ] {
        let mut c = cfg.clone();
        c[key] = value;
        std::fs::write(&cfg_path, c.to_string()).unwrap();
        let msg = load_dir(tmp.path()).unwrap_or_else(|| panic!("{key} must be refused"));
        assert!(msg.contains(expect) && msg.contains("config.json"), "{msg}");
    }
}

#[test]
fn chat_tokens_mask_assistant_turns_of_the_tiny_template() {
    let p = load("tiny-qwen2");
    let msgs = [Message::user("Up?"), Message::assistant("<answer>Up</answer>")];
    let ct = p.chat_tokens(&msgs, false).unwrap();
    let masked: Vec<u32> = ct.ids.iter().zip(&ct.assistant_mask).filter(|(_, &m)| m).map(|(&i, _)| i).collect();
    assert_eq!(p.tokenizer.decode(&masked, false).unwrap(), "<answer>Up</answer><|im_end|>");
    assert_eq!(p.decode(&ct.ids).unwrap(), "user\nUp?\nassistant\n<answer>Up</answer>\n");
}

#[test]
fn critic_values_train_and_round_trip() {
    let p = load("tiny-qwen2");
    let critic = Critic::from_policy(&p, 3).unwrap();
    let b = batch(&p);
    let v = critic.values_no_grad(&b).unwrap();
    assert_eq!(v.dims(), &[b.rows, b.len]);
    let mut grads = GradStore::default();
    critic.loss_and_grads(&b, |v| Ok(v.sqr()?.sum_all()?), &mut grads).unwrap();
    for (n, var) in critic.named_vars() {
        assert!(grads.get(var.as_tensor()).is_some(), "critic: no gradient for {n}");
    }
    assert!(grads.get(p.vars()[0].as_tensor()).is_none(), "the critic is a separate copy");
    let tmp = tempfile::tempdir().unwrap();
    critic.save(tmp.path(), &p.spec).unwrap();
    let back = Critic::load(tmp.path(), &p).unwrap();
    assert_eq!(max_abs_diff(&back.values_no_grad(&b).unwrap(), &v), 0.0);
}

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ragen-lab")).args(args).output().unwrap()
}

#[test]
fn model_score_json_is_tokens_and_logprobs_with_a_null_first() {
    let text = "<think>Up</think><answer>Up</answer>";
    let out = cli(&["model", "score", "tiny-llama", "--text", text, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 2, "exactly tokens and logprobs: {v}");
    let p = load("tiny-llama");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, p.encode(text).unwrap());
    let lps = v["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), ids.len());
    assert!(lps[0].is_null());
    let want = p.token_logprobs_no_grad(&TokenBatch::new(&[ids], p.pad_id).unwrap()).unwrap();
    let want = want.logprobs.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
    for (got, want) in lps[1..].iter().zip(&want[1..]) {
        assert!((got.as_f64().unwrap() as f32 - want).abs() < 1e-5);
    }
}

#[test]
fn model_chat_streams_a_reply_and_info_describes_the_model() {
    let out = cli(&["model", "chat", "tiny-qwen2", "--prompt", "Up or Down?", "--max-tokens", "6"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p = load("tiny-qwen2");
    let cfg = GenerationConfig { max_new_tokens: 6, temperature: 0.0, ..Default::default() };
    let g = p.generate(&[chat_plain(&p, "Up or Down?")], &cfg, &mut Rng::new(0)).unwrap().remove(0);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end_matches('\n'), g.text);

    let out = cli(&["model", "info", "tiny-llama"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("LlamaForCausalLM") && text.contains("<|im_end|>"), "{text}");
    let out = cli(&["model", "info", "no-such-model-here"]);
    assert_eq!(out.status.code(), Some(2));
}

fn chat_plain(p: &Policy, user: &str) -> Vec<u32> {
    p.chat_tokens(&[Message::user(user)], true).unwrap().ids
}

/// A group's trajectories: one prompt, different replies (as a rollout packs them).
fn group(p: &Policy) -> (Vec<Vec<u32>>, usize) {
    let prompt = chat(p, "Dragon or Phoenix? Answer in <answer></answer>.");
    let replies = ["<answer>Dragon</answer>", "<answer>Phoenix</answer>", "Dragon", "<answer>Up || Down</answer> ok"];
    let seqs = replies.iter().map(|r| [prompt.clone(), p.encode(r).unwrap()].concat()).collect();
    (seqs, prompt.len())
}

/// A group packed as a tree shares more than its prompt: one reply twice (an episode whose
/// history matches another's) and a second turn on top of a first.
fn tree_group(p: &Policy) -> (Vec<Vec<u32>>, usize) {
    let (mut seqs, first_reply) = group(p);
    seqs.push(seqs[0].clone());
    seqs.push([seqs[1].clone(), p.encode("<answer>Dragon</answer>").unwrap()].concat());
    (seqs, first_reply)
}

/// [`tree_group`] with a long second turn on every trajectory, alike on some: a tree of several
/// of the model's attention blocks (128 queries), whose later blocks see only their branches.
fn long_tree_group(p: &Policy) -> (Vec<Vec<u32>>, usize) {
    let (seqs, first_reply) = tree_group(p);
    let turn = |i: usize| {
        let light = ["Red", "Green", "Amber"][i % 3];
        chat(p, &format!("The light ahead is {light}. Recall the last three lights, then answer Go or Stop in <answer></answer>; you are scored at the end on every light."))
    };
    (
        seqs.into_iter()
            .enumerate()
            .map(|(i, s)| [s, turn(i), p.encode("<answer>Go</answer>").unwrap()].concat())
            .collect(),
        first_reply,
    )
}

#[test]
fn a_packed_tree_runs_each_distinct_position_once_with_the_rows_scores_and_gradients() {
    // (model, trajectories, how many times fewer positions the tree runs at least)
    for (name, (seqs, first_reply), fewer) in PRESETS.iter().flat_map(|&name| {
        let p = load(name);
        [(name, tree_group(&p), 3), (name, long_tree_group(&p), 1)]
    }) {
        let p = load(name);
        let plain = TokenBatch::new(&seqs, p.pad_id).unwrap();
        let tree = plain.clone().as_tree();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        assert_eq!(tree.tokens_computed(), ragen_lab::agent::pack::distinct_positions(&refs));
        assert!(tree.tokens_computed() < plain.tokens_computed() / fewer, "{name}: the prompt and the copies run once");
        // Every position's scores are the rows'.
        let (a, b) = (p.token_logprobs_no_grad(&plain).unwrap(), p.token_logprobs_no_grad(&tree).unwrap());
        let d = max_abs_diff(&a.logprobs, &b.logprobs).max(max_abs_diff(&a.entropy, &b.entropy));
        assert!(d < 1e-5, "{name}: tree scores differ by {d}");
        // A PPO-like loss on the replies only: gradients equal the rows'.
        let lens: Vec<usize> = seqs.iter().map(Vec::len).collect();
        let mask: Vec<f32> = (0..plain.rows)
            .flat_map(|r| (0..plain.len).map(|t| (t >= first_reply && t < lens[r]) as u8 as f32).collect::<Vec<_>>())
            .collect();
        let mask = Tensor::from_vec(mask, (plain.rows, plain.len), &Device::Cpu).unwrap();
        let loss = |s: &ragen_lab::policy::Scored| -> anyhow::Result<Tensor> {
            Ok(((s.logprobs.exp()? * &mask)?.sum_all()? + ((&s.entropy * &mask)?.sum_all()? * 0.1)?)?)
        };
        let (mut ga, mut gb) = (GradStore::default(), GradStore::default());
        let va = p.loss_and_grads(&plain, loss, &mut ga).unwrap();
        let vb = p.loss_and_grads(&tree, loss, &mut gb).unwrap();
        assert!((va - vb).abs() < 1e-4, "{name}: loss {va} vs {vb}");
        for (n, v) in p.model.named_vars() {
            let d = max_abs_diff(ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap());
            assert!(d < 1e-5, "{name} {n}: tree gradient differs by {d}");
        }
        // The critic's values at every position, too.
        let critic = Critic::from_policy(&p, 3).unwrap();
        let (va, vb) = (critic.values_no_grad(&plain).unwrap(), critic.values_no_grad(&tree).unwrap());
        assert!(max_abs_diff(&va, &vb) < 1e-5, "{name}: critic values differ");
    }
}

#[test]
fn score_only_scores_the_trained_positions_and_split_keeps_the_packing() {
    let p = load("tiny-llama");
    let (seqs, first_reply) = tree_group(&p);
    let masks: Vec<Vec<bool>> = seqs.iter().map(|s| (0..s.len()).map(|t| t >= first_reply).collect()).collect();
    let refs: Vec<&[bool]> = masks.iter().map(Vec::as_slice).collect();
    let all = TokenBatch::new(&seqs, p.pad_id).unwrap().as_tree();
    let some = all.clone().score_only(&refs);
    let (a, b) = (p.token_logprobs_no_grad(&all).unwrap(), p.token_logprobs_no_grad(&some).unwrap());
    let keep = some.score_mask(&Device::Cpu).unwrap();
    assert_eq!(max_abs_diff(&(&a.logprobs * &keep).unwrap(), &b.logprobs), 0.0, "scored positions unchanged");
    let outside = (&b.logprobs * (1.0 - &keep).unwrap()).unwrap().abs().unwrap().sum_all().unwrap();
    assert_eq!(outside.to_scalar::<f32>().unwrap(), 0.0, "the prompt is not scored");
    for micro in some.split(2) {
        assert!(micro.tree.is_some(), "micro-batches stay packed");
        assert!(micro.tokens_computed() < micro.rows * micro.len);
    }
}

/// A restricted position is scored over its allowed tokens: restricted to its own token it has
/// log-prob 0 and entropy 0, restricted to the whole vocabulary it scores as before; a packed
/// tree keeps apart two rows that share the position but restrict it differently.
#[test]
fn restricted_positions_score_over_their_allowed_tokens_rows_and_tree_alike() {
    let p = load("tiny-llama");
    let (seqs, first_reply) = tree_group(&p);
    let vocab: std::sync::Arc<[u32]> = (0..p.model.cfg.vocab_size as u32).collect();
    // Row 0 restricted to its own token at each reply position; row 4 (its copy) free; row 1 over
    // the whole vocabulary.
    let allowed: Vec<Vec<Option<std::sync::Arc<[u32]>>>> = seqs
        .iter()
        .enumerate()
        .map(|(r, s)| {
            (0..s.len())
                .map(|t| match (r, t >= first_reply) {
                    (0, true) => Some(vec![s[t]].into()),
                    (1, true) => Some(vocab.clone()),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[Option<std::sync::Arc<[u32]>>]> = allowed.iter().map(Vec::as_slice).collect();
    let free = TokenBatch::new(&seqs, p.pad_id).unwrap();
    let base = p.token_logprobs_no_grad(&free).unwrap();
    for batch in [free.clone(), free.clone().as_tree()] {
        let packed = batch.tree.is_some();
        let got = p.token_logprobs_no_grad(&batch.restrict(&refs)).unwrap();
        let (lp, ent) = (got.logprobs.to_vec2::<f32>().unwrap(), got.entropy.to_vec2::<f32>().unwrap());
        let (blp, bent) = (base.logprobs.to_vec2::<f32>().unwrap(), base.entropy.to_vec2::<f32>().unwrap());
        for t in first_reply..seqs[0].len() {
            assert!(lp[0][t].abs() < 1e-6 && ent[0][t].abs() < 1e-6, "tree {packed}: row 0 at {t}");
            assert!((lp[4][t] - blp[4][t]).abs() < 1e-5, "tree {packed}: the free copy at {t}");
            assert!(blp[4][t] < -1e-3, "a random model is unsure");
        }
        for t in first_reply..seqs[1].len() {
            let d = (lp[1][t] - blp[1][t]).abs().max((ent[1][t] - bent[1][t]).abs());
            assert!(d < 1e-4, "tree {packed}: the whole vocabulary at {t} differs by {d}");
        }
    }
}

/// Gradients of a PPO-like loss on the replies for the policy and of a value loss for the critic.
fn reply_grads(p: &Policy, critic: &Critic, b: &TokenBatch, first_reply: usize) -> Vec<(String, Tensor)> {
    let lens = b.lengths.clone();
    let mask: Vec<f32> = (0..b.rows)
        .flat_map(|r| (0..b.len).map(|t| (t >= first_reply && t < lens[r]) as u8 as f32).collect::<Vec<_>>())
        .collect();
    let mask = Tensor::from_vec(mask, (b.rows, b.len), &Device::Cpu).unwrap();
    let (mut g, mut gc) = (GradStore::default(), GradStore::default());
    let loss = |s: &ragen_lab::policy::Scored| -> anyhow::Result<Tensor> {
        Ok(((s.logprobs.exp()? * &mask)?.sum_all()? + ((&s.entropy * &mask)?.sum_all()? * 0.1)?)?)
    };
    p.loss_and_grads(b, loss, &mut g).unwrap();
    critic.loss_and_grads(b, |v| Ok(((v - 0.5)?.sqr()? * &mask)?.sum_all()?), &mut gc).unwrap();
    let mut out: Vec<(String, Tensor)> =
        p.model.named_vars().into_iter().map(|(n, v)| (n, g.get(v.as_tensor()).unwrap().clone())).collect();
    for (n, v) in critic.named_vars() {
        out.push((format!("critic.{n}"), gc.get(v.as_tensor()).unwrap_or_else(|| panic!("critic {n}")).clone()));
    }
    // A gradient that still records its graph keeps the pass's activations alive (every
    // checkpointed layer's at once, gigabytes at 135M).
    for (n, g) in &out {
        assert!(!g.track_op(), "{n}: the stored gradient holds its backward graph");
    }
    out
}

#[test]
fn checkpointed_layers_give_the_gradients_of_the_full_graph() {
    for name in PRESETS {
        let mut p = load(name);
        let mut critic = Critic::from_policy(&p, 3).unwrap();
        let (seqs, first_reply) = tree_group(&p);
        let plain = TokenBatch::new(&seqs, p.pad_id).unwrap();
        let tree = plain.clone().as_tree();
        for b in [&plain, &tree] {
            p.model.checkpoint_layers = false;
            critic.backbone.checkpoint_layers = false;
            let full = reply_grads(&p, &critic, b, first_reply);
            p.model.checkpoint_layers = true;
            critic.backbone.checkpoint_layers = true;
            let ck = reply_grads(&p, &critic, b, first_reply);
            for ((n, a), (_, c)) in full.iter().zip(&ck) {
                let scale = a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(scale > 0.0, "{name} {n}: no gradient");
                let d = max_abs_diff(a, c);
                assert!(
                    d <= 1e-5 * scale.max(1.0),
                    "{name} tree {} {n}: checkpointed gradient differs by {d}",
                    b.tree.is_some()
                );
            }
        }
    }
}

#[test]
fn prefilling_a_shared_prompt_once_generates_what_the_full_prefill_does() {
    for name in PRESETS {
        let p = load(name);
        // Two groups of three episodes with one prompt each, plus an unrelated prompt.
        let (a, b) = (chat(&p, "Dragon or Phoenix?"), chat(&p, "Go Left or Right, then Down?"));
        let prompts = vec![a.clone(), a.clone(), a, b.clone(), b.clone(), b, vec![1, 2, 3]];
        for temperature in [0.0, 1.0] {
            let cfg = GenerationConfig { max_new_tokens: 8, temperature, ..Default::default() };
            let shared = p.generate(&prompts, &cfg, &mut Rng::new(5)).unwrap();
            let full = p
                .generate(&prompts, &GenerationConfig { share_prefixes: false, ..cfg.clone() }, &mut Rng::new(5))
                .unwrap();
            for (i, (s, f)) in shared.iter().zip(&full).enumerate() {
                assert_eq!(s.ids, f.ids, "{name} row {i} at temperature {temperature}");
                for (x, y) in s.logprobs.iter().zip(&f.logprobs) {
                    assert!((x - y).abs() < 1e-4, "{name} row {i}: log-prob {x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn a_turn_that_resumes_the_last_one_generates_what_a_full_prefill_does() {
    for name in PRESETS {
        let p = load(name);
        let prompts = vec![chat(&p, "Dragon or Phoenix?"), chat(&p, "Dragon or Phoenix?"), chat(&p, "Go Left")];
        let cfg = GenerationConfig { max_new_tokens: 6, temperature: 1.0, ..Default::default() };
        let none: Vec<Option<ragen_lab::policy::Resume>> = (0..3).map(|_| None).collect();
        let (first, kept) = p.generate_resuming(&prompts, &none, true, &cfg, &mut Rng::new(9)).unwrap();
        let kept: Vec<_> = kept.into_iter().map(|r| r.unwrap()).collect();
        for (k, (g, pr)) in kept.iter().zip(first.iter().zip(&prompts)) {
            assert_eq!(k.len(), pr.len() + g.ids.len() - 1, "{name}: the prompt and the tokens fed back");
        }
        // Next turn: the conversation so far plus a new user message; row 2 changed its history
        // (as a context window would), so only part of its resume applies.
        let next_user = p.encode("Now go Down.").unwrap();
        let mut next: Vec<Vec<u32>> =
            prompts.iter().zip(&first).map(|(pr, g)| [pr.clone(), g.ids.clone(), next_user.clone()].concat()).collect();
        next[2] = [chat(&p, "Go Right"), next_user.clone()].concat();
        let resumed = p
            .generate_resuming(&next, &kept.into_iter().map(Some).collect::<Vec<_>>(), false, &cfg, &mut Rng::new(4))
            .unwrap()
            .0;
        let full =
            p.generate(&next, &GenerationConfig { share_prefixes: false, ..cfg.clone() }, &mut Rng::new(4)).unwrap();
        for (i, (a, b)) in resumed.iter().zip(&full).enumerate() {
            assert_eq!(a.ids, b.ids, "{name} row {i}");
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "{name} row {i}: log-prob {x} vs {y}");
            }
        }
    }
}

/// A batch tempered at t scores each position under softmax(logits / t), the distribution a
/// sampler at temperature t drew from, in the no-graph pass and in the training pass alike.
#[test]
fn tempered_batches_score_the_distribution_the_sampler_drew_from() {
    let p = load("tiny-llama");
    let ids = chat(&p, "Go or Stop?");
    for t in [0.5f32, 2.0] {
        let batch = TokenBatch::new(std::slice::from_ref(&ids), p.pad_id)
            .unwrap()
            .tempered(Temperature { text: t, answer: 1.0 });
        let lp = p.token_logprobs_no_grad(&batch).unwrap().logprobs.to_vec2::<f32>().unwrap();
        let trained = p.token_logprobs(&batch).unwrap().logprobs.to_vec2::<f32>().unwrap();
        for pos in [1, ids.len() / 2, ids.len() - 1] {
            let z: Vec<f64> = logits_of(&p, &ids[..pos]).iter().map(|&x| x as f64 / t as f64).collect();
            let lse = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            let lse = lse + z.iter().map(|&x| (x - lse).exp()).sum::<f64>().ln();
            let want = (z[ids[pos] as usize] - lse) as f32;
            assert!((lp[0][pos] - want).abs() < 1e-4, "t {t} at {pos}: {} vs {want}", lp[0][pos]);
            assert!((trained[0][pos] - want).abs() < 1e-4, "t {t} at {pos} (training pass)");
        }
    }
}

/// `answer_temperature` tempers only the draws among several allowed tokens: a constrained
/// answer's first token is drawn from softmax(logits / t) over the allowed set, and its
/// reported log-prob is of that distribution (what a `Temperature { answer: t, .. }` update
/// scores).
#[test]
fn an_answer_temperature_tempers_the_constrained_choice_and_its_logprob() {
    use ragen_lab::policy::constrain::AnswerGrammar;
    let p = load("tiny-llama");
    let actions: Vec<String> = ["Walrus", "Quokka"].map(String::from).to_vec();
    let prompt = chat(&p, "Walrus or Quokka?");
    let grammar = AnswerGrammar::new(&actions, 1, true).unwrap();
    let allowed = grammar.next_tokens("", &[], &p.token_texts()).expect("the answer is constrained");
    assert!(allowed.len() > 1);
    let z = logits_of(&p, &prompt);
    for t in [1.0f64, 3.0] {
        let cfg = GenerationConfig {
            max_new_tokens: 1,
            temperature: 1.0,
            answer_temperature: Some(t),
            constraint: Some(grammar.clone()),
            ..Default::default()
        };
        for g in p.generate(&vec![prompt.clone(); 4], &cfg, &mut Rng::new(5)).unwrap() {
            let scaled: Vec<f64> = allowed.iter().map(|&id| z[id as usize] as f64 / t).collect();
            let max = scaled.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            let lse = max + scaled.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
            let k = allowed.iter().position(|&id| id == g.ids[0]).expect("an allowed token");
            assert!(
                (g.logprobs[0] as f64 - (scaled[k] - lse)).abs() < 1e-4,
                "t {t}: {} vs {}",
                g.logprobs[0],
                scaled[k] - lse
            );
        }
    }
}

/// A value slot's characters are copied, not chosen: under `answer_temperature` the choice
/// between actions is drawn hot, the digits of `pay {digits}` at the text temperature, and each
/// reported log-prob is of the distribution it was drawn from (the update scores the same:
/// `TokenBatch::restrict_values`).
#[test]
fn a_value_slot_is_drawn_at_the_text_temperature_and_the_choice_hot() {
    use ragen_lab::policy::constrain::AnswerGrammar;
    let p = load("tiny-llama");
    let actions: Vec<String> = ["pay {digits}", "refuse"].map(String::from).to_vec();
    let grammar = p.canonical(AnswerGrammar::new(&actions, 1, true).unwrap());
    let prompt = chat(&p, "Pay the amount due, or refuse.");
    let texts = p.token_texts();
    let (text_t, answer_t) = (1.0f64, 3.0f64);
    let cfg = GenerationConfig {
        max_new_tokens: 6,
        temperature: text_t,
        answer_temperature: Some(answer_t),
        constraint: Some(grammar.clone()),
        ..Default::default()
    };
    let (mut values, mut choices) = (0, 0);
    for g in p.generate(&vec![prompt.clone(); 8], &cfg, &mut Rng::new(3)).unwrap() {
        for k in 0..g.ids.len() {
            let reply: String = g.ids[..k].iter().map(|&id| texts[id as usize].as_str()).collect();
            let Some(allowed) = grammar.next_tokens(&reply, &g.ids[..k], &texts) else { break };
            if allowed.len() < 2 {
                continue;
            }
            let value = grammar.in_value(&reply, &g.ids[..k], &texts);
            let t = if value { text_t } else { answer_t };
            (values, choices) = (values + usize::from(value), choices + usize::from(!value));
            let z = logits_of(&p, &[prompt.as_slice(), &g.ids[..k]].concat());
            let scaled: Vec<f64> = allowed.iter().map(|&id| z[id as usize] as f64 / t).collect();
            let max = scaled.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            let lse = max + scaled.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
            let at = allowed.iter().position(|&id| id == g.ids[k]).expect("an allowed token");
            let want = scaled[at] - lse;
            assert!(
                (g.logprobs[k] as f64 - want).abs() < 1e-3,
                "{reply:?} (value {value}): {} vs {want}",
                g.logprobs[k]
            );
        }
    }
    assert!(values > 0 && choices > 0, "values {values}, choices {choices}");
}

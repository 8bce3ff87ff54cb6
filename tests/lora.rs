//! LoRA on the tiny presets: fresh adapters change nothing, only adapters train and the base
//! stays frozen, checkpointed layers (dropout included) give the full graph's gradients, the
//! PEFT folder round-trips, merging equals the adapter model (library and `model merge`), and a
//! PPO + KL run trains adapters for the policy and the critic on one shared base and resumes to
//! the unbroken run's adapters.
use std::path::Path;
use std::process::Command;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use ragen_lab::policy::lora::{self, LoraConfig};
use ragen_lab::policy::{Message, Policy, Scored, TokenBatch};
use ragen_lab::rng::Rng;
use ragen_lab::starpo::optim::AdamW;

const BIN: &str = env!("CARGO_BIN_EXE_ragen-lab");

fn load(name: &str) -> Policy {
    Policy::load(name, &Device::Cpu).unwrap()
}

fn group(p: &Policy) -> TokenBatch {
    let prompt = p.chat_tokens(&[Message::user("Dragon or Phoenix? Answer in <answer></answer>.")], true).unwrap().ids;
    let seqs: Vec<Vec<u32>> = ["<answer>Dragon</answer>", "<answer>Phoenix</answer>", "Dragon"]
        .iter()
        .map(|r| [prompt.clone(), p.encode(r).unwrap()].concat())
        .collect();
    TokenBatch::new(&seqs, p.pad_id).unwrap()
}

fn logits(p: &Policy, b: &TokenBatch) -> Tensor {
    p.token_logprobs_no_grad(b).unwrap().logprobs
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn loss(s: &Scored) -> anyhow::Result<Tensor> {
    Ok(((s.logprobs.sum_all()? * -1.0)? - (s.entropy.sum_all()? * 0.1)?)?)
}

/// Gives every adapter's B random values, so the adapters change the model.
fn perturb(p: &Policy, seed: u64) {
    let mut rng = Rng::new(seed);
    for (name, v) in lora::named_vars(&p.model) {
        if name.contains("lora_B") {
            let n = v.as_tensor().elem_count();
            let data: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 0.2).collect();
            v.set(&Tensor::from_vec(data, v.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
        }
    }
}

fn cfg(dropout: f64) -> LoraConfig {
    LoraConfig::new(4, 8.0, "all-linear", dropout).unwrap()
}

#[test]
fn fresh_adapters_change_nothing_and_only_adapters_train() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let mut p = load(name);
        let b = group(&p);
        let before = logits(&p, &b);
        let base_vars = p.model.named_vars();
        lora::attach(&mut p.model, &cfg(0.0), 1).unwrap();
        assert_eq!(max_abs_diff(&before, &logits(&p, &b)), 0.0, "{name}: B = 0 leaves the model as it was");
        let adapters = p.model.trainable_vars();
        assert_eq!(adapters.len(), 2 * 7 * p.model.cfg.num_hidden_layers, "{name}: A and B on every projection");

        let mut grads = GradStore::default();
        let l0 = p.loss_and_grads(&b, loss, &mut grads).unwrap();
        for (n, v) in &base_vars {
            assert!(grads.get(v.as_tensor()).is_none(), "{name}: the frozen {n} got a gradient");
        }
        for (n, v) in adapters.iter().filter(|(n, _)| n.contains("lora_B")) {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient for {n}"));
            assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "{name}: {n}");
        }
        let frozen: Vec<Tensor> = base_vars.iter().map(|(_, v)| v.as_tensor().copy().unwrap()).collect();
        let mut opt = AdamW::new(adapters, 1e-2, &Default::default()).unwrap();
        for _ in 0..3 {
            let mut g = GradStore::default();
            p.loss_and_grads(&b, loss, &mut g).unwrap();
            opt.step(&g, 1.0).unwrap();
        }
        let l1 = p.loss_and_grads(&b, loss, &mut GradStore::default()).unwrap();
        assert!(l1 < l0 - 0.1, "{name}: adapter steps lower the loss: {l0} → {l1}");
        for ((n, v), f) in base_vars.iter().zip(&frozen) {
            assert_eq!(max_abs_diff(v.as_tensor(), f), 0.0, "{name}: {n} moved");
        }
        // The reference shares the base weights without the adapters: the model before training.
        let reference = p.reference(true).unwrap();
        assert_eq!(max_abs_diff(&before, &logits(&reference, &b)), 0.0);
        assert!(max_abs_diff(&before, &logits(&p, &b)) > 1e-3);
    }
}

#[test]
fn checkpointed_lora_layers_with_dropout_give_the_full_graphs_gradients() {
    let mut p = load("tiny-qwen2");
    lora::attach(&mut p.model, &cfg(0.2), 1).unwrap();
    perturb(&p, 5);
    let plain = group(&p);
    let tree = plain.clone().as_tree();
    assert!(tree.tokens_computed() < plain.tokens_computed());
    for b in [&plain, &tree] {
        let run = |p: &mut Policy, checkpoint: bool| {
            p.model.checkpoint_layers = checkpoint;
            p.model.dropout_seed.store(77, std::sync::atomic::Ordering::Relaxed);
            let mut g = GradStore::default();
            let l = p.loss_and_grads(b, loss, &mut g).unwrap();
            (l, g)
        };
        let (la, ga) = run(&mut p, false);
        let (lb, gb) = run(&mut p, true);
        assert!((la - lb).abs() < 1e-4, "loss {la} vs {lb}");
        for (n, v) in p.model.trainable_vars() {
            let (a, c) = (ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap());
            let d = max_abs_diff(a, c);
            assert!(d < 1e-5, "tree {}: {n} differs by {d}", b.tree.is_some());
        }
    }
    // Dropout is live in training passes: another seed, another loss.
    p.model.dropout_seed.store(1234, std::sync::atomic::Ordering::Relaxed);
    let other = p.loss_and_grads(&plain, loss, &mut GradStore::default()).unwrap();
    p.model.dropout_seed.store(77, std::sync::atomic::Ordering::Relaxed);
    let again = p.loss_and_grads(&plain, loss, &mut GradStore::default()).unwrap();
    assert_ne!(other, again);
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_peft_folder_round_trips_and_merging_gives_the_adapter_models_outputs() {
    let mut p = load("tiny-llama");
    lora::attach(&mut p.model, &LoraConfig::new(4, 8.0, "q_proj,v_proj,down_proj", 0.0).unwrap(), 1).unwrap();
    perturb(&p, 9);
    let b = group(&p);
    let adapted = logits(&p, &b);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("adapter");
    p.save(&dir).unwrap();

    // PEFT's layout: its config keys and tensor names, A [r, in] and B [out, r].
    let c = read_json(&dir.join("adapter_config.json"));
    assert_eq!(
        (c["peft_type"].as_str(), c["r"].as_u64(), c["lora_alpha"].as_f64()),
        (Some("LORA"), Some(4), Some(8.0))
    );
    assert_eq!(c["base_model_name_or_path"], "tiny-llama");
    assert_eq!(c["target_modules"], serde_json::json!(["q_proj", "v_proj", "down_proj"]));
    let t = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let h = p.model.cfg.hidden_size;
    assert_eq!(t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].dims(), &[4, h]);
    assert_eq!(t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].dims(), &[h, 4]);
    assert_eq!(t.len(), 2 * 3 * p.model.cfg.num_hidden_layers);

    let back = load("tiny-llama").load_saved(&dir).unwrap();
    assert_eq!(max_abs_diff(&adapted, &logits(&back, &b)), 0.0, "the adapter loads back exactly");

    let mut merged = back;
    lora::merge(&mut merged.model).unwrap();
    assert!(merged.model.lora.is_none());
    let d = max_abs_diff(&adapted, &logits(&merged, &b));
    assert!(d < 1e-4, "merged weights give the adapter model's log-probs (differ by {d})");

    // The CLI, from the adapter folder, as an HF folder and a GGUF file that load back.
    let out = tmp.path().join("merged");
    let o = Command::new(BIN).args(["model", "merge"]).arg(&dir).arg("--out").arg(&out).arg("--gguf").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for spec in [out.clone(), out.join("model.gguf")] {
        let m = load(spec.to_str().unwrap());
        assert!(m.model.lora.is_none());
        let d = max_abs_diff(&adapted, &logits(&m, &b));
        assert!(d < 1e-4, "{}: merged model differs by {d}", spec.display());
    }
    // A full model is not an adapter: a clear error.
    let o =
        Command::new(BIN).args(["model", "merge"]).arg(&out).arg("--out").arg(tmp.path().join("x")).output().unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not an adapter folder"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_lora_ppo_run_trains_policy_and_critic_adapters_on_one_base_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for f in ["envs/bandit.rhai", "prompts/ragen.rhai", "rewards/format_penalty.rhai", "scripts/bandit.rhai"] {
        let to = dir.path().join(f);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(root.join(f), to).unwrap();
    }
    let train = |extra: &[&str]| {
        let o = Command::new(BIN)
            .current_dir(dir.path())
            .args(["train", "--algo", "ppo", "--model", "tiny-llama", "--quiet"])
            .args([
                "--set",
                "rollout.env_groups=2",
                "--set",
                "rollout.group_size=2",
                "--set",
                "rollout.response_length=8",
            ])
            .args(["--set", "train.val_every=0", "--set", "lora.rank=4", "--set", "lora.dropout=0.1"])
            .args(["--set", "starpo.kl_coef=0.01", "--set", "optim.checkpoint_layers=true", "--set", "optim.lr=1e-3"])
            .args(["--set", "optim.graph_budget_mb=0"]) // checkpoint even these tiny passes
            .args(extra)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
    };
    train(&["--env", "scripts/bandit.rhai", "--steps", "2", "--run-dir", "runs/lora"]);
    let run = dir.path().join("runs/lora");
    let ckpt = run.join("checkpoints/step-000002");
    for f in [
        "policy/adapter_config.json",
        "policy/adapter_model.safetensors",
        "critic/adapter_config.json",
        "critic/value_head.safetensors",
        "optimizer.safetensors",
    ] {
        assert!(ckpt.join(f).exists(), "checkpoint lacks {f}");
    }
    assert!(!ckpt.join("policy/model.safetensors").exists(), "no full copy of the frozen base");
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for m in &metrics {
        for key in ["update/pg_loss", "update/value_loss", "update/kl", "update/grad_norm"] {
            assert!(m[key].as_f64().is_some_and(f64::is_finite), "{key}: {m}");
        }
    }
    assert!(metrics[1]["update/kl"].as_f64().unwrap() != 0.0, "the adapters moved the policy off the reference");
    train(&["--resume", "runs/lora", "--steps", "3"]);
    // Resumed from step 2, step 3 equals an unbroken 3-step run's, adapter dropout included.
    train(&["--env", "scripts/bandit.rhai", "--steps", "3", "--run-dir", "runs/straight"]);
    for f in ["policy/adapter_model.safetensors", "critic/adapter_model.safetensors", "critic/value_head.safetensors"] {
        let read = |run: &str| std::fs::read(dir.path().join(run).join("checkpoints/step-000003").join(f)).unwrap();
        assert!(read("runs/lora") == read("runs/straight"), "{f} after resume differs from the unbroken run's");
    }
}

//! The policy's tools end to end: our logits against PyTorch's for tiny fixture models, model
//! specs resolved through a Hugging Face cache laid out on disk, and `ragen-lab model pull`'s
//! refusals (wrong name, wrong file). The network is never needed: `HF_HUB_OFFLINE=1` throughout.
//!
//! The fixtures in tests/fixtures/tiny-*-ref/ were written by `write_reference_fixture_models`
//! (ignored; run by hand) and their `reference.json` by tools/reference_logits.py with transformers.
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use ragen_lab::policy::model::Mode;
use ragen_lab::policy::{load, Policy, TokenBatch};
use serde_json::Value;
use sha2::{Digest, Sha256};

const FIXTURES: &[&str] = &["tiny-llama-ref", "tiny-qwen2-ref"];
/// How far our f32 logits may sit from transformers' (computed in f32, stored as f64).
const TOLERANCE: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn reference(dir: &Path) -> Value {
    let path = dir.join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let r: Value = serde_json::from_str(&text).unwrap();
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    assert_eq!(
        hex::encode(Sha256::digest(&weights)),
        r["model_sha256"].as_str().unwrap(),
        "{}: model.safetensors changed since reference.json was written; run tools/reference_logits.py",
        dir.display()
    );
    r
}

fn ids_of(seq: &Value) -> Vec<u32> {
    seq["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Largest |ours - theirs| over a sequence's [T, V] logits, through the given forward mode.
fn logits_gap(policy: &Policy, seq: &Value, mode: Mode) -> f64 {
    let ids = ids_of(seq);
    let t = ids.len();
    let input = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().reshape((1, t)).unwrap();
    let hidden = policy.model.hidden(&input, &[0], None, mode).unwrap(); // [1, T, H]
    let h = hidden.dim(2).unwrap();
    let ours = policy.model.logits(&hidden.reshape((t, h)).unwrap()).unwrap().to_vec2::<f32>().unwrap();
    let theirs = seq["logits"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len());
    let mut gap = 0f64;
    for (row, want) in ours.iter().zip(theirs) {
        let want = want.as_array().unwrap();
        assert_eq!(row.len(), want.len(), "vocabulary sizes differ");
        for (a, b) in row.iter().zip(want) {
            gap = gap.max((*a as f64 - b.as_f64().unwrap()).abs());
        }
    }
    gap
}

/// Our per-token log-probs (both sequences as one right-padded batch) against transformers'.
fn logprobs_gap(policy: &Policy, seqs: &[Value]) -> f64 {
    let ids: Vec<Vec<u32>> = seqs.iter().map(ids_of).collect();
    let batch = TokenBatch::new(&ids, policy.pad_id).unwrap();
    let ours = policy.token_logprobs_no_grad(&batch).unwrap().logprobs.to_vec2::<f32>().unwrap();
    let mut gap = 0f64;
    for (row, seq) in ours.iter().zip(seqs) {
        for (t, want) in seq["logprobs"].as_array().unwrap().iter().enumerate().skip(1) {
            gap = gap.max((row[t] as f64 - want.as_f64().unwrap()).abs());
        }
    }
    gap
}

fn assert_matches_reference(policy: &Policy, r: &Value, what: &str) {
    let seqs = r["sequences"].as_array().unwrap();
    for (i, seq) in seqs.iter().enumerate() {
        for mode in [Mode::Train, Mode::Sample] {
            let gap = logits_gap(policy, seq, mode);
            eprintln!("{what}, sequence {i}, {mode:?}: largest logit gap {gap:.2e}");
            assert!(gap <= TOLERANCE, "{what}, sequence {i}, {mode:?} mode: logits differ from PyTorch by {gap:e}");
        }
    }
    let gap = logprobs_gap(policy, seqs);
    assert!(gap <= TOLERANCE, "{what}: log-probs differ from PyTorch by {gap:e}");
}

#[test]
fn tiny_models_match_pytorch_reference_logits_from_safetensors_and_from_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let dir = fixture(name);
        let r = reference(&dir);
        // Through the spec resolver, as `--model tests/fixtures/…` would.
        let policy = Policy::load(dir.to_str().unwrap(), &Device::Cpu).unwrap();
        assert_matches_reference(&policy, &r, &format!("{name} (safetensors)"));

        // The same weights through our GGUF writer (Q/K permuted as llama.cpp does) and reader.
        let gguf = tmp.path().join(format!("{name}.gguf"));
        load::save_gguf(&gguf, &policy.model, &policy.tokenizer, &policy.tokenizer_config).unwrap();
        let from_gguf = Policy::load(gguf.to_str().unwrap(), &Device::Cpu).unwrap();
        assert_matches_reference(&from_gguf, &r, &format!("{name} (gguf)"));
    }
}

/// Writes the fixture models with our own code: the tiny presets' tokenizer and families, at a
/// smaller width so the committed files stay small. Run by hand, then tools/reference_logits.py:
/// `cargo test --test policy_tools -- --ignored write_reference_fixture_models`
#[test]
#[ignore = "writes tests/fixtures; run by hand when the fixtures must change"]
fn write_reference_fixture_models() {
    let tmp = tempfile::tempdir().unwrap();
    for (seed, preset) in ["tiny-llama", "tiny-qwen2"].iter().enumerate() {
        let preset_dir = tmp.path().join(preset);
        ragen_lab::policy::preset::write_hf(preset, &preset_dir).unwrap();
        let loaded = load::load_hf_dir(&preset_dir, &Device::Cpu).unwrap();
        let mut cfg = loaded.model.cfg.clone();
        cfg.hidden_size = 32;
        cfg.intermediate_size = 64;
        cfg.num_attention_heads = 4;
        cfg.num_key_value_heads = 2;
        cfg.head_dim = 8;
        let model = ragen_lab::policy::Decoder::random(cfg, 1000 + seed as u64, &Device::Cpu).unwrap();
        let out = fixture(&format!("{preset}-ref"));
        load::save_hf_dir(&out, &model, &loaded.tokenizer, &loaded.tokenizer_config).unwrap();
        eprintln!("wrote {}", out.display());
    }
}

fn ragen_lab(home: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ragen-lab"));
    cmd.env("RAGEN_LAB_HOME", home.join("ragen"))
        .env("HF_HOME", home.join("hf"))
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_OFFLINE", "1");
    cmd
}

fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn hub_id_loads_offline_from_a_hugging_face_cache_snapshot() {
    let home = tempfile::tempdir().unwrap();
    // The layout huggingface_hub writes: refs/main names the snapshot, files sit under snapshots/<rev>/.
    let repo = home.path().join("hf/hub/models--Tiny--Llama");
    let snapshot = repo.join("snapshots/3f2e1d");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "3f2e1d").unwrap();
    for entry in std::fs::read_dir(fixture("tiny-llama-ref")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, snapshot.join(path.file_name().unwrap())).unwrap();
    }
    let (ok, stdout, stderr) = run(ragen_lab(home.path()).args(["model", "info", "Tiny/Llama"]));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("LlamaForCausalLM") && stdout.contains("snapshots/3f2e1d"), "{stdout}");
}

#[test]
fn uncached_hub_id_offline_fails_naming_the_cache_and_the_way_out() {
    let home = tempfile::tempdir().unwrap();
    let (ok, _, stderr) = run(ragen_lab(home.path()).args(["model", "info", "Qwen/Qwen2.5-0.5B-Instruct"]));
    assert!(!ok);
    assert!(stderr.starts_with("ragen-lab: "), "{stderr}");
    for needle in ["models--Qwen--Qwen2.5-0.5B-Instruct", "HF_HUB_OFFLINE", "HF_HOME"] {
        assert!(stderr.contains(needle), "missing {needle:?} in: {stderr}");
    }
}

#[test]
fn known_model_missing_offline_says_to_pull_it() {
    let home = tempfile::tempdir().unwrap();
    let (ok, _, stderr) = run(ragen_lab(home.path()).args(["model", "info", "smollm2-135m"]));
    assert!(!ok);
    assert!(stderr.contains("ragen-lab model pull smollm2-135m"), "{stderr}");
}

#[test]
fn pull_refuses_a_file_whose_sha256_is_not_the_pinned_one_and_keeps_nothing() {
    let home = tempfile::tempdir().unwrap();
    let fake = home.path().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::write(&fake, b"GGUF but not the real thing").unwrap();
    let (ok, _, stderr) = run(ragen_lab(home.path()).args(["model", "pull", "smollm2-135m", "--from"]).arg(&fake));
    assert!(!ok);
    assert!(stderr.contains("sha256") && stderr.contains("b179c952"), "{stderr}");
    let cached = home.path().join("ragen/models/smollm2-135m");
    let left: Vec<_> = std::fs::read_dir(&cached).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn pull_of_an_unknown_name_lists_what_it_can_pull() {
    let home = tempfile::tempdir().unwrap();
    let (ok, _, stderr) = run(ragen_lab(home.path()).args(["model", "pull", "llama-70b"]));
    assert!(!ok);
    assert!(
        stderr.contains("`llama-70b` is not a model ragen-lab can pull") && stderr.contains("smollm2-135m"),
        "{stderr}"
    );
}

//! RAGEN-2's template-collapse probe with the policy: score every sampled reasoning trace under
//! every prompt of a small sample (teacher forcing), then read the mutual information off the
//! N×N cross log-prob matrix with [`super::echo_trap::mutual_information`].
//!
//! X is the first-turn prompt up to and including `<think>`, Z the reasoning tokens between the
//! tags (notes/ragen.md §4, RAGEN-2 `collapse_metrics.py`). The caller picks the sample (the
//! trainer: `echo.mi_samples` episodes every `echo.mi_every` steps) and tokenises both parts;
//! this file only scores and reduces.
use super::echo_trap::{mutual_information, MutualInfo};
use crate::policy::{Policy, TokenBatch};
use anyhow::{ensure, Result};

/// `m[i][j]` = log p(z_i | x_j): the summed log-probs of trace i's tokens right after prompt j.
/// Scores N² sequences without gradients, `micro_batch` rows at a time.
pub fn cross_logprobs(
    policy: &Policy,
    prompts: &[Vec<u32>],
    traces: &[Vec<u32>],
    micro_batch: usize,
) -> Result<Vec<Vec<f64>>> {
    ensure!(!prompts.is_empty() && !traces.is_empty(), "template-collapse probe: no prompts or traces to score");
    ensure!(
        prompts.iter().all(|p| !p.is_empty()),
        "template-collapse probe: an empty prompt (it must end with <think>)"
    );
    // Row r = i * N + j holds prompt j followed by trace i.
    let n = prompts.len();
    let pairs: Vec<(usize, usize)> = (0..traces.len()).flat_map(|i| (0..n).map(move |j| (i, j))).collect();
    let mut m = vec![vec![0.0; n]; traces.len()];
    for chunk in pairs.chunks(micro_batch.max(1)) {
        let seqs: Vec<Vec<u32>> = chunk.iter().map(|&(i, j)| [&prompts[j][..], &traces[i][..]].concat()).collect();
        let lp = policy.token_logprobs_no_grad(&TokenBatch::new(&seqs, policy.pad_id)?)?.logprobs.to_vec2::<f32>()?;
        for (row, &(i, j)) in lp.iter().zip(chunk) {
            // Position t scores ids[t]: the trace occupies positions p..p+len.
            let p = prompts[j].len();
            m[i][j] = row[p..p + traces[i].len()].iter().map(|&x| x as f64).sum();
        }
    }
    Ok(m)
}

/// The probe: trace i was sampled after prompt i; returns MI, entropies and retrieval accuracy.
pub fn template_collapse(
    policy: &Policy,
    prompts: &[Vec<u32>],
    traces: &[Vec<u32>],
    micro_batch: usize,
) -> Result<MutualInfo> {
    ensure!(
        prompts.len() == traces.len(),
        "template-collapse probe: {} prompts but {} traces (one trace per prompt)",
        prompts.len(),
        traces.len()
    );
    let m = cross_logprobs(policy, prompts, traces, micro_batch)?;
    mutual_information(&m, &(0..prompts.len()).collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn each_entry_is_the_trace_scored_alone_after_its_prompt() {
        let policy = Policy::preset("tiny-llama", &Device::Cpu).unwrap();
        let prompts = vec![vec![5, 6, 7], vec![9, 10], vec![11, 12, 13, 14]];
        let traces = vec![vec![20, 21], vec![22, 23, 24], vec![25]];
        let m = cross_logprobs(&policy, &prompts, &traces, 4).unwrap();
        for (i, t) in traces.iter().enumerate() {
            for (j, p) in prompts.iter().enumerate() {
                let seq = [&p[..], &t[..]].concat();
                let lp = policy.token_logprobs_no_grad(&TokenBatch::new(&[seq], policy.pad_id).unwrap()).unwrap();
                let row = lp.logprobs.to_vec2::<f32>().unwrap().remove(0);
                let alone: f64 = row[p.len()..].iter().map(|&x| x as f64).sum();
                assert!((m[i][j] - alone).abs() < 1e-3, "m[{i}][{j}] = {} vs {alone}", m[i][j]);
                assert!(m[i][j] < 0.0);
            }
        }
    }

    #[test]
    fn identical_prompts_carry_no_information() {
        // Every prompt the same: the policy cannot tell them apart, MI 0, retrieval at chance.
        let policy = Policy::preset("tiny-llama", &Device::Cpu).unwrap();
        let prompts = vec![vec![5, 6, 7]; 4];
        let traces = vec![vec![20, 21], vec![22, 23], vec![24], vec![25, 26, 27]];
        let r = template_collapse(&policy, &prompts, &traces, 16).unwrap();
        assert!(r.mi.abs() < 1e-4, "{r:?}");
        assert!((r.retrieval_accuracy - 0.25).abs() < 1e-9, "{r:?}");
        let err = template_collapse(&policy, &prompts, &traces[..3], 16).unwrap_err().to_string();
        assert!(err.contains("4 prompts but 3 traces"), "{err}");
    }
}

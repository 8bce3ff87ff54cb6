//! One thread owns generation: requests that arrive while a batch runs wait, and the next batch
//! takes the oldest one together with every waiting request for the same weights that samples
//! the same way (equal `GenerationConfig`), up to `max_batch` rows, into one call of the batched sampler. Concurrent
//! clients therefore share forward passes, as in a continuous-batching engine, at the grain of
//! whole requests. Each request draws from its own random stream, seeded by its `seed` (else by
//! the server's), so a seeded request samples the same tokens whatever it is batched with.
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::policy::{Draws, Generation, GenerationConfig, Policy};
use crate::rng::Rng;

/// How long the first request of an idle server waits for others that arrive with it.
const GATHER: Duration = Duration::from_millis(5);

/// One request for the sampler.
pub struct Job {
    /// The weights asked for (the base model or an adapter on it).
    pub policy: Arc<Policy>,
    pub prompt: Vec<u32>,
    pub cfg: GenerationConfig,
    /// The request's `seed`; without one, the server's stream picks it.
    pub seed: Option<u64>,
    /// Each id as it is sampled (streaming); dropped when the generation ends.
    pub tokens: Option<Sender<u32>>,
    pub reply: Sender<Result<Generation, String>>,
}

/// Starts the generation thread; jobs go to the returned sender.
pub fn start(max_batch: usize, seed: u64) -> Sender<Job> {
    let (tx, rx) = channel();
    std::thread::spawn(move || run(&rx, max_batch.max(1), seed));
    tx
}

fn run(rx: &Receiver<Job>, max_batch: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut waiting: VecDeque<Job> = VecDeque::new();
    loop {
        if waiting.is_empty() {
            let Ok(job) = rx.recv() else { return };
            waiting.push_back(job);
            let until = Instant::now() + GATHER;
            while waiting.len() < max_batch {
                match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => break,
                }
            }
        }
        waiting.extend(rx.try_iter());
        let (cfg, policy) = (waiting[0].cfg.clone(), waiting[0].policy.clone());
        let (mut batch, mut rest) = (Vec::new(), VecDeque::new());
        for job in waiting.drain(..) {
            if batch.len() < max_batch && job.cfg == cfg && Arc::ptr_eq(&job.policy, &policy) {
                batch.push(job);
            } else {
                rest.push_back(job);
            }
        }
        waiting = rest;
        let prompts: Vec<Vec<u32>> = batch.iter().map(|j| j.prompt.clone()).collect();
        let mut rngs: Vec<Rng> = batch.iter().map(|j| Rng::new(j.seed.unwrap_or_else(|| rng.next_u64()))).collect();
        let result = policy.generate_with(&prompts, &cfg, Draws::PerRow(&mut rngs), |row, id| {
            if let Some(tx) = &batch[row].tokens {
                let _ = tx.send(id);
            }
        });
        match result {
            Ok(gens) => {
                for (job, gen) in batch.into_iter().zip(gens) {
                    let _ = job.reply.send(Ok(gen));
                }
            }
            Err(e) => {
                for job in batch {
                    let _ = job.reply.send(Err(format!("generation failed: {e:#}")));
                }
            }
        }
    }
}

//! The decoder: Llama and Qwen2 families in one block (RMSNorm, RoPE, grouped-query attention,
//! SwiGLU; Qwen2 adds a Q/K/V bias), weights as candle `Var`s under their Hugging Face names.
//!
//! One forward pass serves three modes over the same weights:
//! - `Mode::Train`: differentiable ops only (on the CPU our fused RMSNorm, RoPE and masked causal
//!   softmax with their own backward, `kernels`; elsewhere the composite candle ops), so every
//!   weight receives a gradient. candle's fused ops silently cut the graph (shared/notes/candle-cpu.md §1).
//! - `Mode::Score`: Train's ops on detached weights: bit-identical values, no graph, so every
//!   intermediate is freed as soon as the next op has read it (old and reference log-probs).
//! - `Mode::Sample`: fused no-grad kernels on detached weights and a pre-allocated `KvCache`.
//!
//! Tokens come in one of two orders ([`Order`]). Rows carry their own positions: `starts[b]` is
//! the index of row b's first real token, so a left-padded row's first token sits at RoPE
//! position 0 and its padding is masked out of attention; right padding needs no mask beyond
//! causality (starts are 0). A packed prefix tree (`tree::PrefixTree`, training and scoring) is
//! one row whose tokens sit at their depth and see their ancestors only: every distinct
//! position of a group's trajectories runs once, and a shared position's gradient is the sum of
//! its children's, exactly. Sampling can still run a prompt's shared prefix once (`prefix`) and
//! copy its keys and values into each row's cache. No file I/O here.
use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};

use std::sync::Arc;

use super::config::Config;
use super::kernels::{self, project};
use super::linear::LoraConfig;
pub use super::linear::{Linear, Mode, PROJECTIONS};
use super::tree::{QueryBlock, TreeLinks};
use crate::rng::Rng;

#[derive(Clone)]
pub struct Layer {
    pub input_layernorm: Var,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub post_attention_layernorm: Var,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// The layer's two norms, after `model.layers.{l}.`: before attention and before the MLP.
const NORMS: [&str; 2] = ["input_layernorm.weight", "post_attention_layernorm.weight"];

/// Queries of a packed tree attended to together: small enough that a block's keys stay near
/// its own ancestors, large enough for its products to run as GEMMs.
pub(crate) const QUERY_BLOCK: usize = 128;

impl Layer {
    /// The projections' `[out, in]` shapes and whether each has a bias, in `PROJECTIONS` order.
    fn projection_specs(cfg: &Config) -> [([usize; 2], bool); 7] {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (q, kv) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
        let b = cfg.family.qkv_bias();
        [([q, h], b), ([kv, h], b), ([kv, h], b), ([h, q], false), ([i, h], false), ([i, h], false), ([h, i], false)]
    }

    /// Every tensor of a layer with its shape, named after `model.layers.{l}.`, in HF order.
    fn weight_specs(cfg: &Config) -> Vec<(String, Vec<usize>)> {
        let h = cfg.hidden_size;
        let projections =
            Self::projection_specs(cfg).map(|([rows, cols], bias)| (vec![rows, cols], bias.then(|| vec![rows])));
        hf_order([vec![h], vec![h]], projections)
    }

    /// A layer from its tensors, `take(name)` by the names of `weight_specs`.
    fn from_named(cfg: &Config, mut take: impl FnMut(&str) -> Result<Var>) -> Result<Self> {
        let mut linears = Vec::with_capacity(PROJECTIONS.len());
        for (path, (_, bias)) in PROJECTIONS.iter().zip(Self::projection_specs(cfg)) {
            let weight = take(&format!("{path}.weight"))?;
            let bias = if bias { Some(take(&format!("{path}.bias"))?) } else { None };
            linears.push(Linear { weight, bias, lora: None });
        }
        let [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]: [Linear; 7] =
            linears.try_into().map_err(|_| anyhow::anyhow!("a layer has seven projections"))?;
        Ok(Layer {
            input_layernorm: take(NORMS[0])?,
            post_attention_layernorm: take(NORMS[1])?,
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            gate_proj,
            up_proj,
            down_proj,
        })
    }

    /// The projections with their module path after `model.layers.{l}.`.
    pub fn linears(&self) -> [(&'static str, &Linear); 7] {
        let fields =
            [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj, &self.gate_proj, &self.up_proj, &self.down_proj];
        let mut names = PROJECTIONS.into_iter();
        fields.map(|l| (names.next().expect("one name per projection"), l))
    }

    pub fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 7] {
        let fields = [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
        ];
        let mut names = PROJECTIONS.into_iter();
        fields.map(|l| (names.next().expect("one name per projection"), l))
    }

    /// Every weight a gradient can reach: the layer's own and its adapters'.
    fn all_vars(&self) -> Vec<&Var> {
        let mut out: Vec<&Var> = self.named_vars().into_iter().map(|(_, v)| v).collect();
        for (_, lin) in self.linears() {
            if let Some(ad) = &lin.lora {
                out.extend([&ad.a, &ad.b]);
            }
        }
        out
    }

    /// The layer's weights, named as in HF after `model.layers.{l}.`, in HF order.
    pub fn named_vars(&self) -> Vec<(String, &Var)> {
        let projections = self.linears().map(|(_, lin)| (&lin.weight, lin.bias.as_ref()));
        hf_order([&self.input_layernorm, &self.post_attention_layernorm], projections)
    }
}

/// A layer's items named after `model.layers.{l}.` in HF's order: the first norm, the attention
/// projections, the second norm, the MLP projections; each projection's weight, then its bias.
/// `projections` follow `PROJECTIONS`.
fn hf_order<T>(norms: [T; 2], projections: [(T, Option<T>); 7]) -> Vec<(String, T)> {
    let [first, second] = norms;
    let mut out = vec![(NORMS[0].to_string(), first)];
    let mut second = Some(second);
    for (path, (weight, bias)) in PROJECTIONS.iter().zip(projections) {
        if path.starts_with("mlp.") {
            if let Some(norm) = second.take() {
                out.push((NORMS[1].to_string(), norm));
            }
        }
        out.push((format!("{path}.weight"), weight));
        out.extend(bias.map(|b| (format!("{path}.bias"), b)));
    }
    out
}

/// Take the gradient of `t` out of a backward pass's store, detached. candle's gradients are
/// built with graph-recording ops from the forward pass's tensors (a weight's is `xᵀ · dy`), so
/// a gradient kept as it comes keeps that pass's whole graph alive: across the checkpointed
/// layers' passes that was every layer's activations at once (~115 MB a layer for SmolLM2).
pub fn take_grad(store: &mut GradStore, t: &Tensor) -> Option<Tensor> {
    store.remove(t).map(|g| g.detach())
}

/// Move the gradients of `vars` from `from` into `into`, adding where `into` has one already.
/// The rest of `from` is dropped: candle's backward also leaves gradients on the constants a
/// graph reads (RoPE tables, masks, broadcasts), hundreds of MB per pass that nothing uses.
pub fn move_grads<'a>(
    into: &mut GradStore,
    mut from: GradStore,
    vars: impl IntoIterator<Item = &'a Var>,
) -> Result<()> {
    for v in vars {
        if let Some(g) = take_grad(&mut from, v.as_tensor()) {
            let g = match into.remove(v.as_tensor()) {
                Some(acc) => (acc + g)?,
                None => g,
            };
            into.insert(v.as_tensor(), g);
        }
    }
    Ok(())
}

/// The transformer with its weights. `lm_head` is `None` when tied to `embed_tokens`.
/// A clone shares the weights (a `Var` is a shared handle); `deep_copy` copies them.
#[derive(Clone)]
pub struct Decoder {
    pub cfg: Config,
    pub embed_tokens: Var,
    pub layers: Vec<Layer>,
    pub norm: Var,
    pub lm_head: Option<Var>,
    /// Training passes keep only each layer's input and recompute the layer in the backward
    /// pass (activation checkpointing): about a third more compute, a fraction of the memory.
    pub checkpoint_layers: bool,
    /// With `checkpoint_layers`, a pass whose graph is estimated at most this many bytes keeps
    /// it anyway (`graph_bytes`): checkpoints save memory, and memory under this is not
    /// worth the recomputation. 0: every pass checkpoints.
    pub graph_budget: usize,
    /// The adapters' settings while the projections carry LoRA adapters (`lora::attach`);
    /// the decoder's own weights are then frozen.
    pub lora: Option<LoraConfig>,
    /// Seeds the adapters' dropout: one draw per training pass (the trainer sets it per step).
    pub dropout_seed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Keys and values of every layer, allocated once for `capacity` positions.
pub struct KvCache {
    /// Per layer: k, v as [B, n_kv, capacity, head_dim].
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(cfg: &Config, batch: usize, capacity: usize, device: &Device) -> Result<Self> {
        let shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim);
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| Ok((Tensor::zeros(shape, DType::F32, device)?, Tensor::zeros(shape, DType::F32, device)?)))
            .collect::<Result<_>>()?;
        Ok(Self { layers, len: 0, capacity })
    }

    /// Positions filled so far (the same for every row).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Mark the first `len` positions as filled (the next forward pass writes from there).
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity);
    }

    /// Copy the first `n` positions of a shared prefix's keys and values into batch row `row`
    /// at positions `at..`.
    pub fn write_prefix(&mut self, row: usize, at: usize, prefix: &SharedPrefix, n: usize) -> Result<()> {
        if n > prefix.len {
            bail!("{n} positions asked of a prefix of {}", prefix.len);
        }
        for ((k, v), (pk, pv)) in self.layers.iter().zip(&prefix.layers) {
            let (pk, pv) = if n == prefix.len {
                (pk.clone(), pv.clone())
            } else {
                (pk.narrow(2, 0, n)?.contiguous()?, pv.narrow(2, 0, n)?.contiguous()?)
            };
            k.narrow(0, row, 1)?.slice_set(&pk, 2, at)?;
            v.narrow(0, row, 1)?.slice_set(&pv, 2, at)?;
        }
        Ok(())
    }

    /// A copy of batch row `row`'s positions `at..at + n`, as a prefix to resume from.
    pub fn row(&self, row: usize, at: usize, n: usize) -> Result<SharedPrefix> {
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| {
                let take = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(0, row, 1)?.narrow(2, at, n)?.contiguous()?) };
                Ok((take(k)?, take(v)?))
            })
            .collect::<Result<_>>()?;
        Ok(SharedPrefix { layers, len: n })
    }

    /// Stack caches of the same capacity and length along the batch.
    pub fn cat(caches: Vec<KvCache>) -> Result<KvCache> {
        let mut caches = caches.into_iter();
        let Some(mut first) = caches.next() else { bail!("no caches to stack") };
        let rest: Vec<KvCache> = caches.collect();
        if rest.is_empty() {
            return Ok(first);
        }
        if rest.iter().any(|c| c.len != first.len || c.capacity != first.capacity) {
            bail!("stacking kv caches of different lengths");
        }
        for (l, (k, v)) in first.layers.iter_mut().enumerate() {
            let ks: Vec<&Tensor> = std::iter::once(&*k).chain(rest.iter().map(|c| &c.layers[l].0)).collect();
            let vs: Vec<&Tensor> = std::iter::once(&*v).chain(rest.iter().map(|c| &c.layers[l].1)).collect();
            let (nk, nv) = (Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?);
            *k = nk;
            *v = nv;
        }
        Ok(first)
    }

    /// Keep only the batch rows `keep` (in that order): finished sequences leave the batch.
    pub fn retain(&mut self, keep: &[usize]) -> Result<()> {
        let Some((k0, _)) = self.layers.first() else { return Ok(()) };
        let idx = Tensor::from_vec(keep.iter().map(|&i| i as u32).collect::<Vec<_>>(), keep.len(), k0.device())?;
        for (k, v) in &mut self.layers {
            *k = k.index_select(&idx, 0)?;
            *v = v.index_select(&idx, 0)?;
        }
        Ok(())
    }
}

/// Keys and values of one prefix row, per layer `[1, n_kv, P, head_dim]`, copied into the
/// cache rows that continue it (a prompt shared by several rows, or a row's earlier turn).
pub struct SharedPrefix {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
}

impl SharedPrefix {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Earlier positions a forward pass attends to besides its own tokens.
enum Past<'a> {
    None,
    /// Written into in place (sampling).
    Cache(&'a mut KvCache),
}

/// How the tokens of a pass are laid out and which earlier ones each sees.
#[derive(Clone, Copy)]
pub enum Order<'a> {
    /// Rows, each causal from its first real token `starts[b]` (left padding before it).
    Rows(&'a [usize]),
    /// One row holding a packed prefix tree: each token at its depth, seeing its ancestors.
    Tree(&'a Arc<TreeLinks>),
}

/// `(name, shape)` of every weight in HF naming and order.
pub fn weight_names(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let h = cfg.hidden_size;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_hidden_layers {
        out.extend(
            Layer::weight_specs(cfg).into_iter().map(|(name, shape)| (format!("model.layers.{l}.{name}"), shape)),
        );
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// A standard normal draw (Box-Muller) from the project's seeded generator.
pub(crate) fn normal(rng: &mut Rng) -> f32 {
    let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
    let u2 = rng.next_f64();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

impl Decoder {
    /// Build from named tensors; `get(name, shape)` returns the tensor for an HF weight name
    /// (the loader checks the shape and names the file in its errors).
    pub fn from_tensors(cfg: Config, mut get: impl FnMut(&str, &[usize]) -> Result<Tensor>) -> Result<Self> {
        cfg.validate()?;
        let mut vars = std::collections::HashMap::new();
        for (name, shape) in weight_names(&cfg) {
            let t = get(&name, &shape)?.to_dtype(DType::F32)?;
            if t.dims() != shape.as_slice() {
                bail!("tensor {name} has shape {:?}, the config expects {:?}", t.dims(), shape);
            }
            vars.insert(name, Var::from_tensor(&t)?);
        }
        fn take(vars: &mut std::collections::HashMap<String, Var>, name: &str) -> Result<Var> {
            vars.remove(name).with_context(|| format!("missing tensor {name}"))
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Layer::from_named(&cfg, |name| take(&mut vars, &format!("model.layers.{l}.{name}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed_tokens: take(&mut vars, "model.embed_tokens.weight")?,
            norm: take(&mut vars, "model.norm.weight")?,
            lm_head: if cfg.tie_word_embeddings { None } else { Some(take(&mut vars, "lm_head.weight")?) },
            layers,
            cfg,
            checkpoint_layers: false,
            graph_budget: 0,
            lora: None,
            dropout_seed: Default::default(),
        })
    }

    /// Random weights of the real architecture: matrices N(0, 1/fan_in) (so a tiny model's
    /// next-token distribution is far from uniform and greedy text varies), norms near 1, small biases.
    pub fn random(cfg: Config, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = Rng::new(seed);
        Self::from_tensors(cfg, |name, shape| {
            let n: usize = shape.iter().product();
            let std = match shape {
                [_, fan_in] => 1.0 / (*fan_in as f32).sqrt(),
                _ => 0.1,
            };
            let data: Vec<f32> = if name.ends_with("norm.weight") {
                (0..n).map(|_| 1.0 + std * normal(&mut rng)).collect()
            } else {
                (0..n).map(|_| std * normal(&mut rng)).collect()
            };
            Ok(Tensor::from_vec(data, shape, device)?)
        })
    }

    /// Every weight with its HF name, in HF order (the tied lm_head is not listed twice).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed_tokens.clone())];
        for (l, layer) in self.layers.iter().enumerate() {
            out.extend(layer.named_vars().into_iter().map(|(n, v)| (format!("model.layers.{l}.{n}"), v.clone())));
        }
        out.push(("model.norm.weight".to_string(), self.norm.clone()));
        if let Some(h) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), h.clone()));
        }
        out
    }

    /// A deep copy with fresh `Var`s (a reference model, or the critic's backbone).
    pub fn deep_copy(&self) -> Result<Self> {
        let named: std::collections::HashMap<String, Tensor> =
            self.named_vars().into_iter().map(|(n, v)| Ok((n, v.as_tensor().copy()?))).collect::<Result<_>>()?;
        Self::from_tensors(self.cfg.clone(), |name, _| {
            named.get(name).cloned().with_context(|| format!("missing tensor {name}"))
        })
    }

    /// A decoder on the same (shared) weights without adapters.
    pub fn without_adapters(&self) -> Self {
        let mut d = self.clone();
        for layer in &mut d.layers {
            for (_, lin) in layer.linears_mut() {
                lin.lora = None;
            }
        }
        d.lora = None;
        d.dropout_seed = Default::default(); // its own passes, not the original's
        d
    }

    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// The output projection `[V, H]` (the embedding matrix when tied).
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens).as_tensor()
    }

    /// # Shapes
    /// hidden: [N, H] → logits [N, V]
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        if hidden.device().is_cpu() {
            let w = self.lm_head_weight();
            let w = if self.lora.is_some() { w.detach() } else { w.clone() };
            return Ok(kernels::trained_project(hidden, &w)?);
        }
        Ok(hidden.matmul(&self.lm_head_weight().t()?)?)
    }

    /// `logits` without a graph through the weights (sampling, no-grad scoring).
    pub fn logits_no_grad(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(project(hidden, &self.lm_head_weight().detach())?.contiguous()?)
    }

    /// The final hidden states (after the last RMSNorm) for `ids`.
    ///
    /// With a cache, `ids` continue the cached positions and their keys/values are appended.
    /// # Shapes
    /// ids: [B, T] u32, starts: [B] → [B, T, H]
    pub fn hidden(&self, ids: &Tensor, starts: &[usize], cache: Option<&mut KvCache>, mode: Mode) -> Result<Tensor> {
        let past = match cache {
            Some(c) => Past::Cache(c),
            None => Past::None,
        };
        self.forward(ids, Order::Rows(starts), past, None, mode)
    }

    /// The final hidden states of right-padded rows (`tree: None`) or of one packed prefix
    /// tree (`ids` `[1, nodes]`), without a cache.
    /// # Shapes
    /// ids: [B, T] u32 → [B, T, H]
    pub fn packed_hidden(&self, ids: &Tensor, tree: Option<&Arc<TreeLinks>>, mode: Mode) -> Result<Tensor> {
        let zeros = vec![0; ids.dim(0)?];
        self.forward(ids, order(tree, &zeros), Past::None, None, mode)
    }

    /// Run a prefix shared by several rows once (one row, positions 0..P) and keep its keys and
    /// values for their caches.
    pub fn prefix(&self, ids: &[u32], mode: Mode) -> Result<SharedPrefix> {
        if ids.is_empty() {
            bail!("a shared prefix needs at least one token");
        }
        let x = Tensor::from_vec(ids.to_vec(), (1, ids.len()), self.device())?;
        let mut layers = Vec::with_capacity(self.layers.len());
        self.forward(&x, Order::Rows(&[0]), Past::None, Some(&mut layers), mode)?;
        Ok(SharedPrefix { layers, len: ids.len() })
    }

    /// The decoder stack. `record` collects each layer's (roped) keys and values of `ids`.
    fn forward(
        &self,
        ids: &Tensor,
        order: Order<'_>,
        past: Past<'_>,
        record: Option<&mut Vec<(Tensor, Tensor)>>,
        mode: Mode,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let offset = match &past {
            Past::None => 0,
            Past::Cache(c) => c.len,
        };
        if let Past::Cache(c) = &past {
            if offset + t > c.capacity {
                bail!("kv cache full: {} + {t} positions > capacity {}", c.len, c.capacity);
            }
        }
        let seed = (mode == Mode::Train).then(|| self.next_dropout_seed());
        let pass = self.pass(b, t, offset, order, seed)?;
        self.forward_pass(ids, &pass, past, record, mode)
    }

    /// The decoder stack over a pass already laid out.
    fn forward_pass(
        &self,
        ids: &Tensor,
        pass: &Pass<'_>,
        mut past: Past<'_>,
        mut record: Option<&mut Vec<(Tensor, Tensor)>>,
        mode: Mode,
    ) -> Result<Tensor> {
        let (b, t, offset) = (pass.b, pass.t, pass.kv_len - pass.t);
        let mut x = self.embed(ids, mode)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let kv = match &mut past {
                Past::None => LayerPast::None,
                Past::Cache(c) => LayerPast::Cache(&c.layers[l], offset),
            };
            x = self.block(layer, &x, pass, kv, record.as_deref_mut(), mode)?;
        }
        if let Past::Cache(c) = past {
            c.len = pass.kv_len;
        }
        self.final_norm(&x, b, t, mode)
    }

    /// Token embeddings, `[B*T, H]`.
    fn embed(&self, ids: &Tensor, mode: Mode) -> Result<Tensor> {
        Ok(self.base(mode).weight(&self.embed_tokens).index_select(&ids.flatten_all()?, 0)?)
    }

    /// # Shapes
    /// x: [B*T, H] → [B, T, H]
    fn final_norm(&self, x: &Tensor, b: usize, t: usize, mode: Mode) -> Result<Tensor> {
        let w = self.base(mode).weight(&self.norm);
        Ok(rms_norm(x, &w, self.cfg.rms_norm_eps, mode)?.reshape((b, t, self.cfg.hidden_size))?)
    }

    /// What every layer of a pass over `[B, T]` tokens after `offset` earlier positions shares.
    fn pass<'a>(
        &self,
        b: usize,
        t: usize,
        offset: usize,
        order: Order<'a>,
        dropout_seed: Option<u64>,
    ) -> Result<Pass<'a>> {
        match order {
            Order::Rows(starts) if starts.len() != b => bail!("{} row starts for a batch of {b}", starts.len()),
            Order::Tree(links) if b != 1 || offset != 0 || links.len() != t => {
                bail!("a tree of {} nodes run as {b} rows of {t} after {offset}", links.len())
            }
            _ => {}
        }
        let dev = self.device();
        let (cos, sin) = self.rope_tables(b, t, offset, order, dev)?;
        // On the CPU the mask is applied inside the fused softmax; elsewhere it is a tensor.
        let mask = match (dev.is_cpu(), order) {
            (true, _) => None,
            (false, Order::Rows(starts)) => Some(attention_mask(b, t, offset, starts, dev)?),
            (false, Order::Tree(links)) => Some(tree_mask(links, dev)?),
        };
        let blocks = match (dev.is_cpu(), order) {
            (true, Order::Tree(links)) => links.query_blocks(QUERY_BLOCK),
            _ => Vec::new(),
        };
        Ok(Pass { b, t, kv_len: offset + t, order, cos, sin, mask, blocks, dropout_seed })
    }

    /// How the decoder's own weights are read in `mode`: frozen (detached) while it has adapters.
    fn base(&self, mode: Mode) -> Mode {
        if self.lora.is_some() && mode == Mode::Train {
            Mode::Score
        } else {
            mode
        }
    }

    fn next_dropout_seed(&self) -> u64 {
        self.dropout_seed.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// One transformer layer: pre-norm attention and SwiGLU MLP, each with its residual.
    /// # Shapes
    /// x: [B*T, H] → [B*T, H]
    fn block(
        &self,
        layer: &Layer,
        x: &Tensor,
        pass: &Pass<'_>,
        kv: LayerPast<'_>,
        record: Option<&mut Vec<(Tensor, Tensor)>>,
        mode: Mode,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps;
        let base = self.base(mode);
        let normed = rms_norm(x, &base.weight(&layer.input_layernorm), eps, mode)?;
        let x = (x + self.attention(layer, &normed, pass, kv, record, mode)?)?;
        let normed = rms_norm(&x, &base.weight(&layer.post_attention_layernorm), eps, mode)?;
        let linear = |lin: &Linear, x: &Tensor| lin.forward(x, mode, base, pass.dropout_seed);
        let gated = swiglu(&linear(&layer.gate_proj, &normed)?, &linear(&layer.up_proj, &normed)?, mode)?;
        let mlp = linear(&layer.down_proj, &gated)?;
        Ok((x + mlp)?)
    }

    /// Final hidden states `[B, T, H]` of a training pass over `ids` (rows, or one packed prefix
    /// tree), without a graph, and the way back into the weights. With `checkpoint_layers` only
    /// each layer's input is kept (a few MB per layer instead of every activation) and the
    /// backward pass recomputes one layer at a time.
    pub fn train_hidden(&self, ids: &Tensor, tree: Option<&Arc<TreeLinks>>) -> Result<(Tensor, Backprop)> {
        let (b, t) = ids.dims2()?;
        let zeros = vec![0; b];
        let seed = self.next_dropout_seed();
        let pass = self.pass(b, t, 0, order(tree, &zeros), Some(seed))?;
        if !self.checkpoint_layers || self.graph_bytes(&pass) <= self.graph_budget {
            let hidden = self.forward_pass(ids, &pass, Past::None, None, Mode::Train)?;
            return Ok((hidden.detach(), Backprop::Graph(hidden)));
        }
        let mut x = self.embed(ids, Mode::Score)?;
        let mut inputs = Vec::with_capacity(self.layers.len() + 1);
        for layer in &self.layers {
            let y = self.block(layer, &x, &pass, LayerPast::None, None, Mode::Score)?;
            inputs.push(std::mem::replace(&mut x, y));
        }
        let hidden = self.final_norm(&x, b, t, Mode::Score)?;
        inputs.push(x);
        let ck = Checkpoints { ids: ids.clone(), tree: tree.cloned(), inputs, seed };
        Ok((hidden, Backprop::Checkpointed(ck)))
    }

    /// The activations a training pass's graph keeps, estimated from what each layer records
    /// per position (norms, projections, RoPE'd heads, the MLP's three wide tensors, residuals)
    /// and per attention pair (scores and probabilities per head). Within 10% of the resident
    /// memory measured on SmolLM2 passes of 200–900 tree nodes (docs/models.md).
    fn graph_bytes(&self, pass: &Pass<'_>) -> usize {
        let c = &self.cfg;
        let (q, kv) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let per_position = 10 * c.hidden_size + 6 * q + 5 * kv + 3 * c.intermediate_size;
        let pairs: usize = match pass.order {
            Order::Tree(_) if !pass.blocks.is_empty() => {
                pass.blocks.iter().map(|blk| (blk.end - blk.start) * blk.key_count()).sum()
            }
            _ => pass.b * pass.t * pass.kv_len,
        };
        let floats = pass.b * pass.t * per_position + 2 * c.num_attention_heads * pairs;
        c.num_hidden_layers * floats * std::mem::size_of::<f32>()
    }

    /// Add into `grads` the gradients of every weight for `Σ grad · hidden`, recomputing layer
    /// by layer from the checkpoints: each layer's gradient w.r.t. its input is the next one's
    /// upstream gradient.
    fn backward_checkpointed(&self, ck: Checkpoints, grad: &Tensor, grads: &mut GradStore) -> Result<()> {
        let (b, t) = ck.ids.dims2()?;
        let zeros = vec![0; b];
        let pass = self.pass(b, t, 0, order(ck.tree.as_ref(), &zeros), Some(ck.seed))?;
        let mut inputs = ck.inputs;
        let x_last = inputs.pop().context("no layer inputs")?;
        let x = Var::from_tensor(&x_last)?;
        let mut top = (self.final_norm(x.as_tensor(), b, t, Mode::Train)? * grad)?.sum_all()?.backward()?;
        let mut g = take_grad(&mut top, x.as_tensor()).context("no gradient reached the last layer")?;
        move_grads(grads, top, [&self.norm])?;
        for (layer, x_in) in self.layers.iter().zip(inputs).rev() {
            let x = Var::from_tensor(&x_in)?;
            let y = self.block(layer, x.as_tensor(), &pass, LayerPast::None, None, Mode::Train)?;
            let mut layer_grads = (y * &g)?.sum_all()?.backward()?;
            g = take_grad(&mut layer_grads, x.as_tensor()).map_or_else(|| x.as_tensor().zeros_like(), Ok)?;
            move_grads(grads, layer_grads, layer.all_vars())?;
        }
        if self.lora.is_some() {
            return Ok(()); // the embedding is frozen
        }
        let surrogate = (self.embed(&ck.ids, Mode::Train)? * g)?.sum_all()?;
        move_grads(grads, surrogate.backward()?, [&self.embed_tokens])
    }

    /// cos/sin of each token's own position, `[B, T, head_dim/2]`, computed in f32 as HF does.
    fn rope_tables(
        &self,
        b: usize,
        t: usize,
        offset: usize,
        order: Order<'_>,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.cfg.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (self.cfg.rope_theta as f32).powf((2 * i) as f32 / self.cfg.head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(b * t * half);
        let mut sin = Vec::with_capacity(b * t * half);
        let positions: Vec<usize> = match order {
            Order::Rows(starts) => {
                starts.iter().flat_map(|&s| (0..t).map(move |j| (offset + j).saturating_sub(s))).collect()
            }
            Order::Tree(links) => links.depth.iter().map(|&d| d as usize).collect(),
        };
        for pos in positions {
            for f in &inv_freq {
                let a = pos as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok((Tensor::from_vec(cos, (b, t, half), dev)?, Tensor::from_vec(sin, (b, t, half), dev)?))
    }

    /// # Shapes
    /// x: [B*T, H] → [B*T, H]
    fn attention(
        &self,
        layer: &Layer,
        x: &Tensor,
        pass: &Pass<'_>,
        past: LayerPast<'_>,
        record: Option<&mut Vec<(Tensor, Tensor)>>,
        mode: Mode,
    ) -> Result<Tensor> {
        let Pass { b, t, kv_len, order, ref cos, ref sin, ref mask, .. } = *pass;
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let group = nh / nkv;
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            Ok(y.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()?) // [B, n, T, hd]
        };
        let linear = |lin: &Linear, x: &Tensor| lin.forward(x, mode, self.base(mode), pass.dropout_seed);
        let q = rope(&heads(linear(&layer.q_proj, x)?, nh)?, cos, sin, mode)?;
        let k = rope(&heads(linear(&layer.k_proj, x)?, nkv)?, cos, sin, mode)?;
        let v = heads(linear(&layer.v_proj, x)?, nkv)?;
        if let Some(r) = record {
            r.push((k.clone(), v.clone()));
        }
        let (k, v) = match past {
            LayerPast::Cache((ck, cv), offset) => {
                ck.slice_set(&k, 2, offset)?;
                cv.slice_set(&v, 2, offset)?;
                (ck.narrow(2, 0, kv_len)?, cv.narrow(2, 0, kv_len)?)
            }
            LayerPast::None => (k, v),
        };
        // Grouped-query attention without copying K/V per head: the `group` query heads that
        // share a KV head are stacked along the query axis (HF's repeat_kv order).
        // Scaling q rather than the scores saves one [T, L] tensor per layer (and its gradient).
        let q = (q * (1.0 / (hd as f64).sqrt()))?;
        if let (Order::Tree(links), None) = (order, mask) {
            let out = tree_attention(&q, &k, &v, links, &pass.blocks, mode)?;
            return linear(&layer.o_proj, &out.transpose(1, 2)?.reshape((t, nh * hd))?);
        }
        let q = q.reshape((b, nkv, group * t, hd))?;
        let scores = q.matmul(&k.t()?)?; // [B, nkv, g*T, L]
        let probs = match mask {
            None => {
                let scores = scores.reshape((b, nkv * group, t, kv_len))?;
                match order {
                    Order::Rows(starts) => kernels::causal_softmax(&scores, kv_len - t, starts, mode == Mode::Train)?,
                    Order::Tree(links) => kernels::tree_softmax(&scores, links, mode == Mode::Train)?,
                }
            }
            Some(mask) => {
                let scores = scores.reshape((b, nkv, group, t, kv_len))?.broadcast_add(mask)?;
                match mode {
                    Mode::Train | Mode::Score => candle_nn::ops::softmax(&scores, D::Minus1)?,
                    Mode::Sample => candle_nn::ops::softmax_last_dim(&scores)?,
                }
            }
        };
        let out = probs.reshape((b, nkv, group * t, kv_len))?.matmul(&v)?; // [B, nkv, g*T, hd]
        let out = out.reshape((b, nh, t, hd))?.transpose(1, 2)?.reshape((b * t, nh * hd))?;
        linear(&layer.o_proj, &out)
    }
}

/// Attention over a packed prefix tree block by block: each block of neighbouring queries
/// multiplies only against the keys one of them sees (its own nodes and the chains above
/// them), not against the whole tree, whose other branches it would mask out.
/// # Shapes
/// q: [1, nh, T, hd] (scaled), k, v: [1, nkv, T, hd] → [1, nh, T, hd]
fn tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    links: &Arc<TreeLinks>,
    blocks: &[QueryBlock],
    mode: Mode,
) -> Result<Tensor> {
    let (_, nh, t, hd) = q.dims4()?;
    let nkv = k.dim(1)?;
    let group = nh / nkv;
    let q = q.reshape((1, nkv, group, t, hd))?;
    let keys = |x: &Tensor, block: &QueryBlock| -> Result<Tensor> {
        let runs =
            block.keys.iter().map(|&(first, n)| x.narrow(2, first, n)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(if runs.len() == 1 { runs[0].clone() } else { Tensor::cat(&runs, 2)? })
    };
    let mut outs = Vec::with_capacity(blocks.len());
    for block in blocks {
        let (n, s) = (block.end - block.start, block.key_count());
        let qb = q.narrow(3, block.start, n)?.reshape((1, nkv, group * n, hd))?;
        let scores = qb.matmul(&keys(k, block)?.t()?)?.reshape((1, nh, n, s))?;
        let probs = kernels::tree_block_softmax(&scores, links, block, mode == Mode::Train)?;
        let out = probs.reshape((1, nkv, group * n, s))?.matmul(&keys(v, block)?)?;
        outs.push(out.reshape((1, nkv, group, n, hd))?);
    }
    Ok(Tensor::cat(&outs, 3)?.reshape((1, nh, t, hd))?)
}

/// Shapes, positions, RoPE tables and mask of one forward pass, shared by its layers.
struct Pass<'a> {
    b: usize,
    t: usize,
    /// Keys each query can see: cached or prefix positions + T.
    kv_len: usize,
    order: Order<'a>,
    /// `[B, T, head_dim/2]`.
    cos: Tensor,
    sin: Tensor,
    /// Additive mask on devices without the fused softmax.
    mask: Option<Tensor>,
    /// A packed tree's query blocks, where the fused softmax runs (CPU).
    blocks: Vec<QueryBlock>,
    /// Set in training passes: seeds the adapters' dropout.
    dropout_seed: Option<u64>,
}

/// Layer inputs of a checkpointed training pass, detached: `[B*T, H]` before each layer, then
/// before the final norm.
pub struct Checkpoints {
    ids: Tensor,
    tree: Option<Arc<TreeLinks>>,
    inputs: Vec<Tensor>,
    /// The pass's dropout seed, for the recomputation.
    seed: u64,
}

/// How a training pass's final hidden states back-propagate into the weights.
pub enum Backprop {
    /// The hidden states with their whole graph.
    Graph(Tensor),
    /// Layer inputs to recompute from (`Decoder::checkpoint_layers`).
    Checkpointed(Checkpoints),
}

impl Backprop {
    /// Add into `grads` the gradients of every weight (and nothing else) for the loss whose
    /// gradient w.r.t. the hidden states is `grad`.
    pub fn backward(self, model: &Decoder, grad: &Tensor, grads: &mut GradStore) -> Result<()> {
        match self {
            Backprop::Graph(hidden) => {
                let vars: Vec<Var> = model.trainable_vars().into_iter().map(|(_, v)| v).collect();
                move_grads(grads, (hidden * grad.detach())?.sum_all()?.backward()?, &vars)
            }
            Backprop::Checkpointed(ck) => model.backward_checkpointed(ck, grad, grads),
        }
    }
}

/// One layer's view of `Past`.
enum LayerPast<'a> {
    None,
    Cache(&'a (Tensor, Tensor), usize),
}

/// Rows from their starts, or the tree when there is one.
fn order<'a>(tree: Option<&'a Arc<TreeLinks>>, starts: &'a [usize]) -> Order<'a> {
    tree.map_or(Order::Rows(starts), Order::Tree)
}

/// Additive mask `[1, 1, 1, T, T]` of a packed prefix tree (devices without the fused kernel):
/// node i sees node j when j is i or one of its ancestors.
pub fn tree_mask(links: &TreeLinks, dev: &Device) -> Result<Tensor> {
    let t = links.len();
    let mut m = vec![f32::NEG_INFINITY; t * t];
    for i in 0..t {
        for (from, to) in links.visible(i) {
            m[i * t + from..=i * t + to].iter_mut().for_each(|x| *x = 0.0);
        }
    }
    Ok(Tensor::from_vec(m, (1, 1, 1, t, t), dev)?)
}

/// Additive mask `[B, 1, 1, T, L]` (devices without the fused kernel; the kernel's tests):
/// query j of row b (cache index offset+j) sees key s when s ≤ offset+j and s is not padding.
/// A padding query still sees itself, so no softmax row is empty.
pub fn attention_mask(b: usize, t: usize, offset: usize, starts: &[usize], dev: &Device) -> Result<Tensor> {
    let kv_len = offset + t;
    let mut m = vec![0f32; b * t * kv_len];
    for (row, &start) in starts.iter().enumerate() {
        for j in 0..t {
            let q = offset + j;
            for s in 0..kv_len {
                if s > q || (s < start && s != q) {
                    m[(row * t + j) * kv_len + s] = f32::NEG_INFINITY;
                }
            }
        }
    }
    Ok(Tensor::from_vec(m, (b, 1, 1, t, kv_len), dev)?)
}

/// # Shapes
/// x: [N, H], weight: [H] → [N, H]
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, mode: Mode) -> Result<Tensor> {
    Ok(match mode {
        Mode::Train | Mode::Score if x.device().is_cpu() => kernels::rms_norm(x, w, eps as f32, mode == Mode::Train)?,
        Mode::Train | Mode::Score => candle_nn::ops::rms_norm_slow(x, w, eps as f32)?,
        Mode::Sample => candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)?,
    })
}

/// # Shapes
/// gate, up: [N, I] → [N, I]
fn swiglu(gate: &Tensor, up: &Tensor, mode: Mode) -> Result<Tensor> {
    if gate.device().is_cpu() {
        return Ok(kernels::swiglu(gate, up, mode == Mode::Train)?);
    }
    Ok((gate.silu()? * up)?)
}

/// Rotary embedding, NeoX/HF "rotate_half" layout, per-row positions.
/// # Shapes
/// x: [B, n, T, hd], cos/sin: [B, T, hd/2] → [B, n, T, hd]
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, mode: Mode) -> Result<Tensor> {
    if mode == Mode::Sample {
        return Ok(candle_nn::rotary_emb::rope(x, cos, sin)?);
    }
    if x.device().is_cpu() {
        return Ok(kernels::rope(x, cos, sin, mode == Mode::Train)?);
    }
    let hd = x.dim(D::Minus1)?;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.unsqueeze(1)?; // [B, 1, T, hd]
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.unsqueeze(1)?;
    let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::config::Family;

    #[test]
    fn a_pass_within_the_graph_budget_keeps_its_graph_and_a_larger_one_checkpoints() {
        let cfg = Config { num_hidden_layers: 2, ..Config::tiny(Family::Llama) };
        let mut model = Decoder::random(cfg, 1, &Device::Cpu).unwrap();
        let ids = Tensor::new(&[[1u32, 4, 5, 6], [1, 4, 7, 8]], &Device::Cpu).unwrap();
        // 2 layers × (8 positions × 196 floats + 2 heads × 2 · 4 · 4 pairs × 2) × 4 bytes.
        let pass = model.pass(2, 4, 0, Order::Rows(&[0, 0]), None).unwrap();
        assert_eq!(model.graph_bytes(&pass), 2 * (8 * 196 + 2 * 2 * 32) * 4);
        let kept = |m: &Decoder| matches!(m.train_hidden(&ids, None).unwrap().1, Backprop::Graph(_));
        model.checkpoint_layers = false;
        assert!(kept(&model), "without checkpoints every pass keeps its graph");
        model.checkpoint_layers = true;
        for (budget, keeps) in [(0, false), (model.graph_bytes(&pass) - 1, false), (model.graph_bytes(&pass), true)] {
            model.graph_budget = budget;
            assert_eq!(kept(&model), keeps, "a budget of {budget} bytes");
        }
    }
}

//! The fused kernels against the composite candle ops they replace: values and gradients on
//! random shapes, with cache offsets and left padding.
use candle_core::{Device, Tensor, Var, D};
use ragen_lab::policy::kernels::{causal_softmax, rms_norm, rope, swiglu, token_scores, trained_project, tree_softmax};
use ragen_lab::policy::model::{attention_mask, tree_mask};
use ragen_lab::policy::tree::PrefixTree;
use ragen_lab::rng::Rng;

fn random(shape: &[usize], rng: &mut Rng) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 6.0).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// The reference: the model's additive mask and candle's differentiable softmax.
fn composite(x: &Tensor, offset: usize, starts: &[usize]) -> Tensor {
    let (b, _, t, l) = x.dims4().unwrap();
    let mask = attention_mask(b, t, offset, starts, &Device::Cpu).unwrap().reshape((b, 1, t, l)).unwrap();
    candle_nn::ops::softmax(&x.broadcast_add(&mask).unwrap(), D::Minus1).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn causal_softmax_matches_mask_plus_softmax_in_values_and_gradients() {
    let mut rng = Rng::new(11);
    // (batch, heads, queries, offset, starts)
    let cases: [(usize, usize, usize, usize, &[usize]); 5] = [
        (1, 1, 1, 0, &[0]),
        (2, 3, 5, 0, &[0, 0]),
        (2, 2, 4, 7, &[0, 3]),
        (3, 6, 1, 12, &[5, 0, 12]),
        (2, 4, 9, 2, &[4, 1]),
    ];
    for (b, h, t, offset, starts) in cases {
        let l = offset + t;
        let x = Var::from_tensor(&random(&[b, h, t, l], &mut rng)).unwrap();
        let weights = random(&[b, h, t, l], &mut rng);
        let ours = causal_softmax(x.as_tensor(), offset, starts, true).unwrap();
        let theirs = composite(x.as_tensor(), offset, starts);
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < 1e-6, "values differ by {d} at {:?}", (b, h, t, offset, starts));
        // A non-trivial loss: Σ w ⊙ softmax.
        let g_ours = (&ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_abs_diff(g_ours.get(x.as_tensor()).unwrap(), g_theirs.get(x.as_tensor()).unwrap());
        assert!(d < 1e-5, "gradients differ by {d} at {:?}", (b, h, t, offset, starts));
        // Without a graph: the same values, nothing to differentiate.
        let plain = causal_softmax(x.as_tensor(), offset, starts, false).unwrap();
        assert_eq!(max_abs_diff(&plain, &ours), 0.0);
    }
}

#[test]
fn tree_softmax_matches_the_tree_mask_plus_softmax_in_values_and_gradients() {
    let mut rng = Rng::new(12);
    // Shared prompts, a copy, branches at several depths, and an unrelated root.
    let seqs: [&[u32]; 6] =
        [&[1, 2, 3, 4, 5], &[1, 2, 3, 9], &[1, 2, 3, 4, 5], &[1, 2, 7, 8, 9, 10], &[1, 6], &[4, 4, 4]];
    let tree = PrefixTree::new(&seqs);
    let t = tree.len();
    for h in [1, 3] {
        let x = Var::from_tensor(&random(&[1, h, t, t], &mut rng)).unwrap();
        let weights = random(&[1, h, t, t], &mut rng);
        let ours = tree_softmax(x.as_tensor(), &tree.links, true).unwrap();
        let mask = tree_mask(&tree.links, &Device::Cpu).unwrap().reshape((1, 1, t, t)).unwrap();
        let theirs = candle_nn::ops::softmax(&x.as_tensor().broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
        assert!(max_abs_diff(&ours, &theirs) < 1e-6, "values");
        let g_ours = (&ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_abs_diff(g_ours.get(x.as_tensor()).unwrap(), g_theirs.get(x.as_tensor()).unwrap());
        assert!(d < 1e-5, "gradients differ by {d}");
    }
    // A chain is the causal case.
    let chain = PrefixTree::new(&[&[5, 6, 7, 8]]);
    let x = random(&[1, 2, 4, 4], &mut rng);
    let d = max_abs_diff(&tree_softmax(&x, &chain.links, false).unwrap(), &causal_softmax(&x, 0, &[0], false).unwrap());
    assert_eq!(d, 0.0);
    assert!(tree_softmax(&random(&[2, 1, 4, 4], &mut rng), &chain.links, false).is_err(), "one tree per pass");
}

#[test]
fn causal_softmax_rejects_shapes_it_cannot_mask() {
    let x = Tensor::zeros((2, 1, 3, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(causal_softmax(&x, 0, &[0], false).unwrap_err().to_string().contains("1 row starts for a batch of 2"));
    assert!(causal_softmax(&x, 1, &[0, 0], false).unwrap_err().to_string().contains("need 4 keys"));
}

#[test]
fn trained_project_is_a_matmul_in_values_and_both_gradients_and_skips_a_frozen_weight() {
    let mut rng = Rng::new(5);
    // Few rows (the (W xᵀ)ᵀ path) and many.
    for rows in [3, 300] {
        let x = Var::from_tensor(&random(&[rows, 24], &mut rng)).unwrap();
        let w = Var::from_tensor(&random(&[40, 24], &mut rng)).unwrap();
        let up = random(&[rows, 40], &mut rng);
        let reference = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let ours = trained_project(x.as_tensor(), w.as_tensor()).unwrap();
        assert!(max_abs_diff(&reference, &ours) < 1e-4, "{rows} rows: values");
        let g_ref = (reference * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (what, v) in [("input", &x), ("weight", &w)] {
            let d = max_abs_diff(g_ref.get(v.as_tensor()).unwrap(), g.get(v.as_tensor()).unwrap());
            assert!(d < 1e-4, "{rows} rows: the {what}'s gradient differs by {d}");
        }
        let frozen = trained_project(x.as_tensor(), &w.as_tensor().detach()).unwrap();
        let g = (frozen * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(x.as_tensor()).is_some(), "the input got no gradient");
        assert!(g.get(w.as_tensor()).is_none(), "the frozen weight got a gradient");
    }
    assert_eq!(trained_project(&random(&[0, 24], &mut rng), &random(&[40, 24], &mut rng)).unwrap().dims(), [0, 40]);
    assert!(trained_project(&random(&[2, 24], &mut rng), &random(&[40, 23], &mut rng)).is_err());
}

#[test]
fn swiglu_matches_silu_times_up_in_values_and_gradients() {
    let mut rng = Rng::new(6);
    for shape in [[1, 1], [7, 33], [300, 100]] {
        let gate = Var::from_tensor(&random(&shape, &mut rng)).unwrap();
        let up = Var::from_tensor(&random(&shape, &mut rng)).unwrap();
        let weights = random(&shape, &mut rng);
        let ours = swiglu(gate.as_tensor(), up.as_tensor(), true).unwrap();
        let theirs = (gate.as_tensor().silu().unwrap() * up.as_tensor()).unwrap();
        assert_eq!(max_abs_diff(&ours, &theirs), 0.0, "{shape:?}: values");
        let g_ours = (&ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        for (what, v) in [("gate", &gate), ("up", &up)] {
            let d = max_abs_diff(g_ours.get(v.as_tensor()).unwrap(), g_theirs.get(v.as_tensor()).unwrap());
            assert!(d < 1e-5, "{shape:?}: the {what} gradient differs by {d}");
        }
        let plain = swiglu(gate.as_tensor(), up.as_tensor(), false).unwrap();
        assert_eq!(max_abs_diff(&plain, &ours), 0.0);
    }
}

#[test]
fn token_scores_match_log_softmax_gather_and_entropy_in_values_and_gradients() {
    let mut rng = Rng::new(17);
    for (n, v) in [(1, 2), (3, 50), (7, 1000)] {
        let z = Var::from_tensor(&(random(&[n, v], &mut rng) * 3.0).unwrap()).unwrap();
        let targets: Vec<u32> = (0..n).map(|_| (rng.next_f64() * v as f64) as u32 % v as u32).collect();
        let weights = random(&[n, 2], &mut rng);
        let ours = token_scores(z.as_tensor(), &targets, &[], true).unwrap();
        // The composite the policy used before: log-softmax, gather, −Σ p log p.
        let logp = candle_nn::ops::log_softmax(z.as_tensor(), D::Minus1).unwrap();
        let tgt = Tensor::from_vec(targets.clone(), (n, 1), &Device::Cpu).unwrap();
        let lp = logp.gather(&tgt, 1).unwrap();
        let ent = (logp.exp().unwrap() * &logp).unwrap().sum_keepdim(1).unwrap().neg().unwrap();
        let theirs = Tensor::cat(&[lp, ent], 1).unwrap();
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < 1e-4, "{n}x{v}: values differ by {d}");
        let g_ours = (&ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_abs_diff(g_ours.get(z.as_tensor()).unwrap(), g_theirs.get(z.as_tensor()).unwrap());
        assert!(d < 1e-5, "{n}x{v}: gradients differ by {d}");
        let plain = token_scores(z.as_tensor(), &targets, &[], false).unwrap();
        assert_eq!(max_abs_diff(&plain, &ours), 0.0);
    }
    let z = Tensor::zeros((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(token_scores(&z, &[0], &[], false).unwrap_err().to_string().contains("1 targets for 2 rows"));
    assert!(token_scores(&z, &[0, 4], &[], false).unwrap_err().to_string().contains("target 4 outside"));
    let off_list = [Some(std::sync::Arc::from(vec![1u32, 2])), None];
    let err = token_scores(&z, &[0, 1], &off_list, false).unwrap_err().to_string();
    assert!(err.contains("target 0 is not among its allowed tokens"), "{err}");
}

/// A constrained position scores the distribution renormalised over its allowed tokens: the
/// composite with every other logit pushed to −1e30, in values and gradients (which are 0 off
/// the list); an unconstrained row beside it is scored as before.
#[test]
fn token_scores_over_allowed_tokens_match_the_masked_composite() {
    let mut rng = Rng::new(29);
    let (n, v) = (3, 40);
    let z = Var::from_tensor(&(random(&[n, v], &mut rng) * 3.0).unwrap()).unwrap();
    let allowed: Vec<Option<std::sync::Arc<[u32]>>> =
        vec![Some(vec![3u32, 7, 11].into()), None, Some(vec![5u32, 30].into())];
    let targets = [7u32, 12, 30];
    let weights = random(&[n, 2], &mut rng);
    let ours = token_scores(z.as_tensor(), &targets, &allowed, true).unwrap();
    let bias: Vec<f32> = (0..n * v)
        .map(|i| match &allowed[i / v] {
            Some(ids) if !ids.contains(&((i % v) as u32)) => -1e30,
            _ => 0.0,
        })
        .collect();
    let masked = (z.as_tensor() + Tensor::from_vec(bias, (n, v), &Device::Cpu).unwrap()).unwrap();
    let logp = candle_nn::ops::log_softmax(&masked, D::Minus1).unwrap();
    let tgt = Tensor::from_vec(targets.to_vec(), (n, 1), &Device::Cpu).unwrap();
    let lp = logp.gather(&tgt, 1).unwrap();
    let ent = (logp.exp().unwrap() * &logp).unwrap().sum_keepdim(1).unwrap().neg().unwrap();
    let theirs = Tensor::cat(&[lp, ent], 1).unwrap();
    let d = max_abs_diff(&ours, &theirs);
    assert!(d < 1e-4, "values differ by {d}");
    let g_ours = (&ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
    let g_theirs = (&theirs * &weights).unwrap().sum_all().unwrap().backward().unwrap();
    let (go, gt) = (g_ours.get(z.as_tensor()).unwrap(), g_theirs.get(z.as_tensor()).unwrap());
    let d = max_abs_diff(go, gt);
    assert!(d < 1e-5, "gradients differ by {d}");
    let row0 = go.get(0).unwrap().to_vec1::<f32>().unwrap();
    assert!(row0.iter().enumerate().all(|(j, &g)| [3, 7, 11].contains(&j) || g == 0.0), "{row0:?}");
}

#[test]
fn rms_norm_matches_the_composite_in_values_and_gradients() {
    let mut rng = Rng::new(23);
    for (n, h) in [(1, 4), (5, 64), (300, 96)] {
        let x = Var::from_tensor(&random(&[n, h], &mut rng)).unwrap();
        let w = Var::from_tensor(&random(&[h], &mut rng)).unwrap();
        let up = random(&[n, h], &mut rng);
        let ours = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5, true).unwrap();
        let theirs = candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < 1e-5, "{n}x{h}: values differ by {d}");
        let g_ours = (&ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (what, v) in [("x", &x), ("w", &w)] {
            let d = max_abs_diff(g_ours.get(v.as_tensor()).unwrap(), g_theirs.get(v.as_tensor()).unwrap());
            assert!(d < 1e-4, "{n}x{h}: gradient of {what} differs by {d}");
        }
        let plain = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5, false).unwrap();
        assert_eq!(max_abs_diff(&plain, &ours), 0.0);
        // A frozen weight gets no gradient.
        let frozen = rms_norm(x.as_tensor(), &w.as_tensor().detach(), 1e-5, true).unwrap();
        let g = (&frozen * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(x.as_tensor()).is_some());
    }
}

/// The composite rotate-half RoPE the training path used before the kernel.
fn rope_composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let hd = x.dim(D::Minus1).unwrap();
    let cos = Tensor::cat(&[cos, cos], D::Minus1).unwrap().unsqueeze(1).unwrap();
    let sin = Tensor::cat(&[sin, sin], D::Minus1).unwrap().unsqueeze(1).unwrap();
    let x1 = x.narrow(D::Minus1, 0, hd / 2).unwrap();
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
    let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
    (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
}

#[test]
fn rope_matches_the_composite_and_candles_sampling_rope_in_values_and_gradients() {
    let mut rng = Rng::new(29);
    for (b, n, t, hd) in [(1, 1, 1, 2), (2, 3, 5, 8), (3, 2, 7, 64)] {
        let x = Var::from_tensor(&random(&[b, n, t, hd], &mut rng)).unwrap();
        let angles = random(&[b, t, hd / 2], &mut rng);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let up = random(&[b, n, t, hd], &mut rng);
        let ours = rope(x.as_tensor(), &cos, &sin, true).unwrap();
        let theirs = rope_composite(x.as_tensor(), &cos, &sin);
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < 1e-5, "{:?}: values differ by {d}", (b, n, t, hd));
        let sampling = candle_nn::rotary_emb::rope(x.as_tensor(), &cos, &sin).unwrap();
        assert!(max_abs_diff(&ours, &sampling) < 1e-5, "{:?}: differs from the sampling path", (b, n, t, hd));
        let g_ours = (&ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_abs_diff(g_ours.get(x.as_tensor()).unwrap(), g_theirs.get(x.as_tensor()).unwrap());
        assert!(d < 1e-5, "{:?}: gradients differ by {d}", (b, n, t, hd));
        let plain = rope(x.as_tensor(), &cos, &sin, false).unwrap();
        assert_eq!(max_abs_diff(&plain, &ours), 0.0);
    }
}

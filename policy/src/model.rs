//! The decoder: token embedding, RMSNorm, rotary position embedding,
//! grouped-query attention (with Qwen2's q/k/v bias), SwiGLU MLP, tied or
//! untied LM head. Parameters live in a `tch::nn::VarStore` under their
//! Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...), so a
//! learner can hand `var_store()` to a `tch` optimizer directly.

use std::collections::{BTreeMap, HashMap};

use tch::{Device, Kind, Tensor, nn};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{PolicyError, Result};
use crate::tokenizer::PolicyTokenizer;
use asyncrl_text::ModelText;

/// How parameters are stored and computed.
///
/// Parameters are always float32. On CUDA the forward pass runs under bf16
/// autocast (matmuls in bf16, norms, softmax and log-probs in float32) when
/// `autocast` is set; on the CPU it is float32 throughout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceOptions {
    pub device: Device,
    /// bf16 autocast on CUDA (ignored on the CPU).
    pub autocast: bool,
}

impl DeviceOptions {
    /// The first CUDA device with bf16 autocast if there is one, else the CPU
    /// in float32.
    pub fn auto() -> Self {
        Self {
            device: Device::cuda_if_available(),
            autocast: true,
        }
    }

    /// The CPU, float32.
    pub fn cpu() -> Self {
        Self {
            device: Device::Cpu,
            autocast: false,
        }
    }

    pub(crate) fn autocast_active(&self) -> bool {
        self.autocast && self.device.is_cuda()
    }
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self::auto()
    }
}

#[derive(Debug)]
pub(crate) struct Linear {
    pub w: Tensor,
    pub b: Option<Tensor>,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.w, self.b.as_ref())?)
    }
}

#[derive(Debug)]
pub(crate) struct Layer {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A decoder-only Llama / Qwen2 policy, with its tokenizer (if any) and the
/// policy version of its current weights.
#[derive(Debug)]
pub struct Policy {
    pub(crate) cfg: ModelConfig,
    pub(crate) vs: nn::VarStore,
    pub(crate) opts: DeviceOptions,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Option<Tensor>,
    inv_freq: Tensor,
    pub(crate) tokenizer: Option<PolicyTokenizer>,
    /// Small files of a Hugging Face folder written back on save
    /// (`tokenizer_config.json`, `generation_config.json`, ...).
    pub(crate) extra_files: BTreeMap<String, Vec<u8>>,
    version: i32,
    generation: u64,
}

/// The parameters of a config, under their Hugging Face names, in a fixed
/// order (embedding, then layer by layer, final norm, LM head if untied).
pub fn parameter_names_and_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<i64>)> {
    let h = cfg.hidden_size;
    let q_out = cfg.num_attention_heads * cfg.head_dim;
    let kv_out = cfg.num_key_value_heads * cfg.head_dim;
    let i = cfg.intermediate_size;
    let mut out = vec![(
        "model.embed_tokens.weight".to_owned(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        for (name, rows, bias) in [
            ("q_proj", q_out, cfg.qkv_bias),
            ("k_proj", kv_out, cfg.qkv_bias),
            ("v_proj", kv_out, cfg.qkv_bias),
        ] {
            out.push((format!("{p}.self_attn.{name}.weight"), vec![rows, h]));
            if bias {
                out.push((format!("{p}.self_attn.{name}.bias"), vec![rows]));
            }
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q_out]));
        if cfg.o_bias {
            out.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
        }
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        for (name, rows, cols) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            out.push((format!("{p}.mlp.{name}.weight"), vec![rows, cols]));
            if cfg.mlp_bias {
                out.push((format!("{p}.mlp.{name}.bias"), vec![rows]));
            }
        }
    }
    out.push(("model.norm.weight".to_owned(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_owned(), vec![cfg.vocab_size, h]));
    }
    out
}

/// How attention finds its keys and values.
pub(crate) enum AttnMode<'a> {
    /// Keys and values of the input itself; `mask` [B, 1, T, T] (true =
    /// attend) or plain causal when None.
    Full { mask: Option<Tensor> },
    /// Keys and values from (and written to) a slot-based KV cache.
    Cached {
        cache: &'a mut KvCache,
        plan: &'a CachePlan,
    },
}

/// How the rows of a full forward pass are laid out.
enum Layout<'a> {
    /// Every row is one whole sequence.
    Full,
    /// `[B, T]` attention mask: 1 = token, 0 = padding.
    Padded(&'a Tensor),
    /// `[B, T]` segment ids: several sequences per row, 0 = padding.
    Packed(&'a Tensor),
    /// Sequences that continue a shared prefix ([`SharedLanes`]).
    Shared(&'a SharedLanes),
}

/// Lanes in which sequences share a prefix (a prompt several completions
/// continue): the prefix is laid out once and each continuation after it,
/// attending to the prefix and to its own earlier tokens only. All three
/// tensors are `[B, T]` int64, aligned with the lanes' token ids.
#[derive(Debug)]
pub struct SharedLanes {
    /// Each token's position in its own sequence (a continuation's first
    /// token is at its prefix's length).
    pub positions: Tensor,
    /// Which part of its lane each token belongs to (a prefix, a
    /// continuation or a whole sequence: 1, 2, ...; ids of adjacent parts
    /// differ; 0 = padding).
    pub segments: Tensor,
    /// For a continuation's tokens, the segment id of the prefix it
    /// continues (laid out earlier in the same lane); 0 otherwise.
    pub parents: Tensor,
}

/// Per-layer key/value tensors of a fixed number of slots, each
/// `[slots, max_len, num_key_value_heads, head_dim]` in the compute dtype.
pub(crate) struct KvCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    pub kind: Kind,
}

impl KvCache {
    pub fn new(policy: &Policy, slots: i64, max_len: i64) -> Result<Self> {
        let cfg = &policy.cfg;
        let kind = policy.compute_kind();
        let shape = [slots, max_len, cfg.num_key_value_heads, cfg.head_dim];
        let mut k = Vec::new();
        let mut v = Vec::new();
        for _ in 0..cfg.num_hidden_layers {
            // Zeros, not uninitialised memory: masked positions are still
            // multiplied by a zero attention weight, and NaN * 0 = NaN.
            k.push(Tensor::f_zeros(shape, (kind, policy.opts.device))?);
            v.push(Tensor::f_zeros(shape, (kind, policy.opts.device))?);
        }
        Ok(Self { k, v, kind })
    }

    fn write(&mut self, layer: usize, k: &Tensor, v: &Tensor, plan: &CachePlan) -> Result<()> {
        // k, v: [A, nkv, Tq, hd] -> rows of [nkv, hd] per (slot, position).
        for (src, dst) in [(k, &mut self.k[layer]), (v, &mut self.v[layer])] {
            let s = src.size();
            let rows = src
                .f_transpose(1, 2)?
                .f_reshape([s[0] * s[2], s[1], s[3]])?;
            let rows = match &plan.write_rows {
                Some(idx) => rows.f_index_select(0, idx)?,
                None => rows,
            };
            let rows = rows.f_to_kind(self.kind)?;
            let _ = dst.f_index_put_(
                &[Some(&plan.write_slots), Some(&plan.write_pos)],
                &rows,
                false,
            )?;
        }
        Ok(())
    }

    /// Copies positions `0..len` of slot `from[i]` into slot `to[i]`, in
    /// every layer (the source rows are read before any is written).
    pub fn copy_slots(&mut self, from: &[i64], to: &[i64], len: i64) -> Result<()> {
        let Some(first) = self.k.first() else {
            return Ok(());
        };
        let device = first.device();
        let from = Tensor::from_slice(from).f_to_device(device)?;
        let to = Tensor::from_slice(to).f_to_device(device)?;
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let src = t.f_narrow(1, 0, len)?.f_index_select(0, &from)?;
            let mut dst = t.f_narrow(1, 0, len)?;
            let _ = dst.f_index_copy_(0, &to, &src)?;
        }
        Ok(())
    }

    fn read(&self, layer: usize, plan: &CachePlan) -> Result<(Tensor, Tensor)> {
        let get = |t: &Tensor| -> Result<Tensor> {
            let rows = match plan.contiguous {
                Some((start, len)) => t.f_narrow(0, start, len)?,
                None => t.f_index_select(0, &plan.slots)?,
            };
            Ok(rows.f_narrow(1, 0, plan.tk)?.f_permute([0, 2, 1, 3])?)
        };
        Ok((get(&self.k[layer])?, get(&self.v[layer])?))
    }
}

/// One forward over cached slots: which slots, where their new tokens go,
/// and the attention mask.
pub(crate) struct CachePlan {
    /// [A] slot of each row.
    pub slots: Tensor,
    /// Some((first, count)) when the rows are the slots first..first+count.
    pub contiguous: Option<(i64, i64)>,
    /// Rows of the flattened [A * Tq] new keys to write (None: all of them).
    pub write_rows: Option<Tensor>,
    pub write_slots: Tensor,
    pub write_pos: Tensor,
    /// [A, Tq] absolute position of each query.
    pub positions: Tensor,
    /// Keys attended: cache positions 0..tk.
    pub tk: i64,
    /// [A, 1, Tq, tk], true = attend.
    pub mask: Tensor,
    /// [A] index (into Tq) of each row's last real token.
    pub last_index: Tensor,
}

impl CachePlan {
    /// `rows[a] = (slot, cached, new)`: slot `slot` holds `cached` positions
    /// and receives `new` (>= 1) tokens now.
    pub fn new(rows: &[(i64, i64, i64)], device: Device) -> Result<Self> {
        let a = rows.len() as i64;
        let tq = rows.iter().map(|r| r.2).max().unwrap_or(1);
        let tk = rows.iter().map(|r| r.1 + r.2).max().unwrap_or(1);
        let slot_ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let contiguous = slot_ids
            .windows(2)
            .all(|w| w[1] == w[0] + 1)
            .then(|| (slot_ids.first().copied().unwrap_or(0), a));
        let mut positions = Vec::with_capacity((a * tq) as usize);
        for &(_, cached, _) in rows {
            positions.extend((0..tq).map(|j| cached + j));
        }
        let (write_rows, write_slots, write_pos) = if tq == 1 {
            let pos: Vec<i64> = rows.iter().map(|r| r.1).collect();
            (None, slot_ids.clone(), pos)
        } else {
            let mut idx = Vec::new();
            let mut ws = Vec::new();
            let mut wp = Vec::new();
            for (i, &(slot, cached, new)) in rows.iter().enumerate() {
                for j in 0..new {
                    idx.push(i as i64 * tq + j);
                    ws.push(slot);
                    wp.push(cached + j);
                }
            }
            (Some(idx), ws, wp)
        };
        let positions = Tensor::from_slice(&positions)
            .f_reshape([a, tq])?
            .f_to_device(device)?;
        let keys = Tensor::f_arange(tk, (Kind::Int64, device))?.f_reshape([1, 1, tk])?;
        let mask = keys
            .f_le_tensor(&positions.f_unsqueeze(-1)?)?
            .f_unsqueeze(1)?;
        let last: Vec<i64> = rows.iter().map(|r| r.2 - 1).collect();
        let to_dev =
            |v: &[i64]| -> Result<Tensor> { Ok(Tensor::from_slice(v).f_to_device(device)?) };
        Ok(Self {
            slots: to_dev(&slot_ids)?,
            contiguous,
            write_rows: write_rows.map(|r| to_dev(&r)).transpose()?,
            write_slots: to_dev(&write_slots)?,
            write_pos: to_dev(&write_pos)?,
            positions,
            tk,
            mask,
            last_index: to_dev(&last)?,
        })
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.f_to_kind(Kind::Float)?;
    let var = xf
        .f_pow_tensor_scalar(2)?
        .f_mean_dim(-1, true, Kind::Float)?;
    let y = xf.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?;
    Ok(w.f_mul(&y.f_to_kind(x.kind())?)?)
}

fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.size().last().copied().unwrap_or(0);
    let x1 = x.f_narrow(-1, 0, d / 2)?;
    let x2 = x.f_narrow(-1, d / 2, d / 2)?;
    Ok(Tensor::f_cat(&[x2.f_neg()?, x1], -1)?)
}

fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let cos = cos.f_to_kind(x.kind())?;
    let sin = sin.f_to_kind(x.kind())?;
    Ok(x.f_mul(&cos)?.f_add(&rotate_half(x)?.f_mul(&sin)?)?)
}

fn repeat_kv(x: Tensor, n: i64) -> Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let s = x.size();
    Ok(x.f_unsqueeze(2)?
        .f_expand([s[0], s[1], n, s[2], s[3]], false)?
        .f_reshape([s[0], s[1] * n, s[2], s[3]])?)
}

/// The inverse frequencies of the rotary embedding, computed as transformers
/// does (float32, `1 / theta^(arange(0, d, 2) / d)`, then the scaling).
fn rope_inv_freq(cfg: &ModelConfig, device: Device) -> Result<Tensor> {
    let d = cfg.head_dim;
    let exps = Tensor::f_arange_start_step(0, d, 2, (Kind::Int64, device))?
        .f_to_kind(Kind::Float)?
        .f_div_scalar(d as f64)?;
    let inv = Tensor::f_pow_scalar(cfg.rope_theta, &exps)?.f_reciprocal()?;
    Ok(match cfg.rope_scaling {
        RopeScaling::None => inv,
        RopeScaling::Linear { factor } => inv.f_div_scalar(factor)?,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            let wavelen = inv
                .f_reciprocal()?
                .f_mul_scalar(2.0 * std::f64::consts::PI)?;
            let scaled = inv.f_div_scalar(factor)?;
            let llama = scaled.f_where_self(&wavelen.f_gt(low_wavelen)?, &inv)?;
            let smooth = wavelen
                .f_reciprocal()?
                .f_mul_scalar(old)?
                .f_sub_scalar(low_freq_factor)?
                .f_div_scalar(high_freq_factor - low_freq_factor)?;
            let smoothed = smooth
                .f_neg()?
                .f_add_scalar(1.0)?
                .f_mul(&llama)?
                .f_div_scalar(factor)?
                .f_add(&smooth.f_mul(&llama)?)?;
            let medium = wavelen
                .f_lt(high_wavelen)?
                .f_logical_not()?
                .f_logical_and(&wavelen.f_gt(low_wavelen)?.f_logical_not()?)?;
            smoothed.f_where_self(&medium, &llama)?
        }
    })
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cfg: &ModelConfig,
        layer: usize,
        mode: &mut AttnMode<'_>,
    ) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let h = rms_norm(x, &self.input_norm, cfg.rms_norm_eps)?;
        let q = self
            .q
            .forward(&h)?
            .f_view([b, t, nh, hd])?
            .f_transpose(1, 2)?;
        let k = self
            .k
            .forward(&h)?
            .f_view([b, t, nkv, hd])?
            .f_transpose(1, 2)?;
        let v = self
            .v
            .forward(&h)?
            .f_view([b, t, nkv, hd])?
            .f_transpose(1, 2)?;
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        let (k, v, mask, causal) = match mode {
            AttnMode::Full { mask } => {
                let causal = mask.is_none();
                (k, v, mask.as_ref().map(Tensor::shallow_clone), causal)
            }
            AttnMode::Cached { cache, plan } => {
                cache.write(layer, &k, &v, plan)?;
                let (k, v) = cache.read(layer, plan)?;
                let kind = q.kind();
                (
                    k.f_to_kind(kind)?,
                    v.f_to_kind(kind)?,
                    Some(plan.mask.shallow_clone()),
                    false,
                )
            }
        };
        let n_rep = cfg.kv_groups();
        let k = repeat_kv(k, n_rep)?;
        let v = repeat_kv(v, n_rep)?;
        let attn = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask.as_ref(),
            0.0,
            causal,
            None::<f64>,
            false,
        )?;
        let attn = attn.f_transpose(1, 2)?.f_reshape([b, t, nh * hd])?;
        let x = x.f_add(&self.o.forward(&attn)?)?;
        let h = rms_norm(&x, &self.post_norm, cfg.rms_norm_eps)?;
        let mlp = self.down.forward(
            &self
                .gate
                .forward(&h)?
                .f_silu()?
                .f_mul(&self.up.forward(&h)?)?,
        )?;
        Ok(x.f_add(&mlp)?)
    }
}

impl Policy {
    /// Builds a policy whose parameters come from `source(name, shape)`
    /// (a float tensor of that shape, on any device, in any float dtype).
    pub(crate) fn build(
        cfg: ModelConfig,
        opts: DeviceOptions,
        source: &mut dyn FnMut(&str, &[i64]) -> Result<Tensor>,
    ) -> Result<Self> {
        cfg.validate()?;
        let vs = nn::VarStore::new(opts.device);
        let mut vars: HashMap<String, Tensor> = HashMap::new();
        tch::no_grad(|| -> Result<()> {
            for (name, shape) in parameter_names_and_shapes(&cfg) {
                let t = source(&name, &shape)?;
                if t.size() != shape {
                    return Err(PolicyError::Weights(format!(
                        "{name}: shape {:?}, expected {shape:?}",
                        t.size()
                    )));
                }
                let t = t.f_to_device(opts.device)?.f_to_kind(Kind::Float)?;
                let mut path = vs.root();
                let mut parts: Vec<&str> = name.split('.').collect();
                let leaf = parts.pop().unwrap_or_default();
                for p in parts {
                    path = path.sub(p);
                }
                let var = path.f_var_copy(leaf, &t)?;
                vars.insert(name, var);
            }
            Ok(())
        })?;
        fn take(vars: &mut HashMap<String, Tensor>, name: &str) -> Result<Tensor> {
            vars.remove(name)
                .ok_or_else(|| PolicyError::Weights(format!("missing parameter {name}")))
        }
        fn lin(vars: &mut HashMap<String, Tensor>, prefix: &str, bias: bool) -> Result<Linear> {
            Ok(Linear {
                w: take(vars, &format!("{prefix}.weight"))?,
                b: if bias {
                    Some(take(vars, &format!("{prefix}.bias"))?)
                } else {
                    None
                },
            })
        }
        let vars = &mut vars;
        let mut layers = Vec::new();
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let q = lin(vars, &format!("{p}.self_attn.q_proj"), cfg.qkv_bias)?;
            let k = lin(vars, &format!("{p}.self_attn.k_proj"), cfg.qkv_bias)?;
            let v = lin(vars, &format!("{p}.self_attn.v_proj"), cfg.qkv_bias)?;
            let o = lin(vars, &format!("{p}.self_attn.o_proj"), cfg.o_bias)?;
            let gate = lin(vars, &format!("{p}.mlp.gate_proj"), cfg.mlp_bias)?;
            let up = lin(vars, &format!("{p}.mlp.up_proj"), cfg.mlp_bias)?;
            let down = lin(vars, &format!("{p}.mlp.down_proj"), cfg.mlp_bias)?;
            layers.push(Layer {
                input_norm: take(vars, &format!("{p}.input_layernorm.weight"))?,
                post_norm: take(vars, &format!("{p}.post_attention_layernorm.weight"))?,
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
            });
        }
        let embed = take(vars, "model.embed_tokens.weight")?;
        let norm = take(vars, "model.norm.weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(take(vars, "lm_head.weight")?)
        };
        let inv_freq = rope_inv_freq(&cfg, opts.device)?;
        Ok(Self {
            cfg,
            vs,
            opts,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            tokenizer: None,
            extra_files: BTreeMap::new(),
            version: 0,
            generation: 0,
        })
    }

    /// The architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.opts.device
    }

    /// Device and autocast settings.
    pub fn device_options(&self) -> DeviceOptions {
        self.opts
    }

    /// The dtype activations (and the KV cache) are computed in: bf16 under
    /// CUDA autocast, else float32.
    pub fn compute_kind(&self) -> Kind {
        if self.opts.autocast_active() {
            Kind::BFloat16
        } else {
            Kind::Float
        }
    }

    /// The tokenizer, when the model folder had one (the built-in model
    /// always has one).
    pub fn tokenizer(&self) -> Option<&PolicyTokenizer> {
        self.tokenizer.as_ref()
    }

    /// Replaces the tokenizer (written by `save_pretrained`).
    pub fn set_tokenizer(&mut self, tokenizer: Option<PolicyTokenizer>) {
        self.tokenizer = tokenizer;
    }

    /// The policy version of the current weights (0 for the initial ones).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Sets the policy version of the current weights (the learner does this
    /// after an optimizer step; `load_weights_from_bytes` does it itself).
    pub fn set_version(&mut self, version: i32) {
        self.version = version;
    }

    /// A counter bumped every time the weights change through this crate
    /// ([`Policy::load_weights_from_bytes`], [`Policy::mark_weights_changed`]).
    /// A [`crate::DecodeBatch`] compares it with the one its KV cache was
    /// computed with, and recomputes the cache when it differs.
    pub fn weights_generation(&self) -> u64 {
        self.generation
    }

    /// Tells decode batches that the weights changed in place (after an
    /// optimizer step on `var_store()` for example), so that their KV caches
    /// are recomputed before the next token.
    pub fn mark_weights_changed(&mut self) {
        self.generation += 1;
    }

    /// The parameters, for an optimizer (`nn::Adam::default().build(policy.var_store(), lr)`).
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// Mutable access to the parameters. Call [`Policy::mark_weights_changed`]
    /// after changing them in place.
    pub fn var_store_mut(&mut self) -> &mut nn::VarStore {
        &mut self.vs
    }

    /// The parameters under their Hugging Face names, in the order of
    /// [`parameter_names_and_shapes`].
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let vars = self.vs.variables();
        parameter_names_and_shapes(&self.cfg)
            .into_iter()
            .filter_map(|(name, _)| vars.get(&name).map(|t| (name, t.shallow_clone())))
            .collect()
    }

    /// A copy of the weights as they are now, frozen (no gradient), on the
    /// same device: the reference policy of a KL loss. It shares nothing
    /// with `self`; later steps do not move it.
    pub fn frozen_copy(&self) -> Result<Self> {
        let vars = self.vs.variables();
        let mut copy = Self::build(self.cfg.clone(), self.opts, &mut |name, _| {
            vars.get(name)
                .map(|t| t.detach().copy())
                .ok_or_else(|| PolicyError::Weights(format!("{name}: not among the parameters")))
        })?;
        copy.vs.freeze();
        copy.version = self.version;
        Ok(copy)
    }

    /// The number of scalar parameters.
    pub fn num_parameters(&self) -> i64 {
        self.named_parameters()
            .iter()
            .map(|(_, t)| t.numel() as i64)
            .sum()
    }

    /// Token ids that end a completion by default: the config's
    /// `eos_token_id` (one or a list) and `generation_config.json`'s.
    pub fn eos_token_ids(&self) -> Vec<i64> {
        let generation_config = self
            .extra_files
            .get("generation_config.json")
            .and_then(|b| serde_json::from_slice(b).ok());
        asyncrl_text::eos_token_ids(
            &self.cfg.eos_token_ids,
            self.cfg.vocab_size,
            generation_config.as_ref(),
        )
    }

    /// The text side of this policy: its tokenizer, stop tokens and chat
    /// template (from the small files of its folder).
    pub fn text(&self) -> Result<ModelText> {
        let tokenizer = self
            .tokenizer
            .clone()
            .ok_or_else(|| PolicyError::InvalidRequest("the model has no tokenizer.json".into()))?;
        let facts = asyncrl_text::ModelFacts {
            bos_token_id: self.cfg.bos_token_id,
            eos_token_ids: self.cfg.eos_token_ids.clone(),
            vocab_size: self.cfg.vocab_size,
            tie_word_embeddings: self.cfg.tie_word_embeddings,
        };
        Ok(ModelText::from_parts(
            "the loaded model".into(),
            tokenizer,
            facts,
            &self.extra_files,
        )?)
    }

    fn rope(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        // positions [B, T] -> cos, sin [B, 1, T, head_dim] in float32
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        Ok((emb.f_cos()?.f_unsqueeze(1)?, emb.f_sin()?.f_unsqueeze(1)?))
    }

    fn check_ids(&self, input_ids: &Tensor) -> Result<()> {
        if input_ids.dim() != 2 {
            return Err(PolicyError::InvalidRequest(format!(
                "input_ids must be [batch, time], got shape {:?}",
                input_ids.size()
            )));
        }
        if input_ids.numel() > 0 {
            let lo = input_ids.f_min()?.f_int64_value(&[])?;
            let hi = input_ids.f_max()?.f_int64_value(&[])?;
            if lo < 0 || hi >= self.cfg.vocab_size {
                return Err(PolicyError::InvalidRequest(format!(
                    "token ids must be in 0..{}, got {lo}..={hi}",
                    self.cfg.vocab_size
                )));
            }
        }
        Ok(())
    }

    fn run_layers(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        mut mode: AttnMode<'_>,
    ) -> Result<Tensor> {
        let ids = input_ids
            .f_to_device(self.opts.device)?
            .f_to_kind(Kind::Int64)?;
        let mut x = Tensor::f_embedding(&self.embed, &ids, -1, false, false)?;
        let (cos, sin) = self.rope(positions)?;
        for (l, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &cos, &sin, &self.cfg, l, &mut mode)?;
        }
        Ok(x)
    }

    /// The final (normed) hidden states `[B, T, hidden]` of a batch.
    ///
    /// `input_ids` is `[B, T]` (int64). `attention_mask` (`[B, T]`, 1 = token,
    /// 0 = padding) is optional: without it every row is a full sequence.
    /// With it, positions are counted over the real tokens only
    /// (`cumsum(mask) - 1`), and padding keys are never attended, so both
    /// right padding (what this crate uses) and left padding give each real
    /// token the same result as an unpadded forward. Outputs at padding
    /// positions are meaningless.
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let layout = match attention_mask {
            None => Layout::Full,
            Some(m) => Layout::Padded(m),
        };
        self.hidden(input_ids, layout)
    }

    /// The final (normed) hidden states `[B, T, hidden]` of packed rows:
    /// each row of `input_ids` (a lane) holds several sequences one after
    /// the other. `segments` (`[B, T]`, int64) numbers them: equal ids on
    /// adjacent positions are one sequence, ids of neighbouring sequences
    /// differ, and 0 is padding. Each sequence's positions start at 0 and
    /// its tokens attend only to earlier tokens of the same sequence, so
    /// every real token gets the result of an unpacked forward of its own
    /// sequence. Outputs at padding positions are meaningless.
    pub fn hidden_states_packed(&self, input_ids: &Tensor, segments: &Tensor) -> Result<Tensor> {
        self.hidden(input_ids, Layout::Packed(segments))
    }

    fn hidden(&self, input_ids: &Tensor, layout: Layout<'_>) -> Result<Tensor> {
        self.check_ids(input_ids)?;
        let (b, t) = (input_ids.size()[0], input_ids.size()[1]);
        let device = self.opts.device;
        let check_shape = |what: &str, m: &Tensor| {
            if m.size() == [b, t] {
                Ok(())
            } else {
                Err(PolicyError::InvalidRequest(format!(
                    "{what} has shape {:?}, input_ids {:?}",
                    m.size(),
                    [b, t]
                )))
            }
        };
        tch::autocast(self.opts.autocast_active(), || -> Result<Tensor> {
            let arange = Tensor::f_arange(t, (Kind::Int64, device))?;
            let causal = || Tensor::f_ones([t, t], (Kind::Bool, device))?.f_tril(0);
            // A padding query attends to itself so that no row is fully
            // masked (NaN); its output is never used.
            let eye = || Tensor::f_eye(t, (Kind::Bool, device));
            let (positions, mask) = match layout {
                Layout::Full => (arange.f_unsqueeze(0)?.f_expand([b, t], false)?, None),
                Layout::Padded(m) => {
                    check_shape("attention_mask", m)?;
                    let keep = m.f_to_device(device)?.f_ne(0)?;
                    let positions = keep
                        .f_cumsum(-1, Kind::Int64)?
                        .f_sub_scalar(1)?
                        .f_clamp_min(0)?;
                    let allowed = causal()?
                        .f_unsqueeze(0)?
                        .f_logical_and(&keep.f_unsqueeze(1)?)?
                        .f_logical_or(&eye()?.f_unsqueeze(0)?)?
                        .f_unsqueeze(1)?;
                    (positions, Some(allowed))
                }
                Layout::Packed(seg) => {
                    check_shape("segments", seg)?;
                    let seg = seg.f_to_device(device)?.f_to_kind(Kind::Int64)?;
                    // A sequence starts where the id changes (and at 0);
                    // a position counts from its sequence's start.
                    let first = Tensor::f_ones([b, 1], (Kind::Bool, device))?;
                    let changed =
                        seg.f_narrow(1, 1, t - 1)?
                            .f_ne_tensor(&seg.f_narrow(1, 0, t - 1)?)?;
                    let starts_here = Tensor::f_cat(&[first, changed], 1)?;
                    let start = arange.f_unsqueeze(0)?.f_mul(&starts_here)?.f_cummax(1)?.0;
                    let positions = arange.f_unsqueeze(0)?.f_sub(&start)?;
                    let same = seg.f_unsqueeze(2)?.f_eq_tensor(&seg.f_unsqueeze(1)?)?;
                    let real_key = seg.f_ne(0)?.f_unsqueeze(1)?;
                    let allowed = causal()?
                        .f_unsqueeze(0)?
                        .f_logical_and(&same)?
                        .f_logical_and(&real_key)?
                        .f_logical_or(&eye()?.f_unsqueeze(0)?)?
                        .f_unsqueeze(1)?;
                    (positions, Some(allowed))
                }
                Layout::Shared(lanes) => {
                    check_shape("positions", &lanes.positions)?;
                    check_shape("segments", &lanes.segments)?;
                    check_shape("parents", &lanes.parents)?;
                    let on = |t: &Tensor| -> Result<Tensor> {
                        Ok(t.f_to_device(device)?.f_to_kind(Kind::Int64)?)
                    };
                    let (seg, parent) = (on(&lanes.segments)?, on(&lanes.parents)?);
                    // Query i sees key j (j ≤ i, a real token) of its own
                    // part or of the prefix its part continues.
                    let key = seg.f_unsqueeze(1)?;
                    let own = seg.f_unsqueeze(2)?.f_eq_tensor(&key)?;
                    let prefix = parent.f_unsqueeze(2)?.f_eq_tensor(&key)?;
                    let real_key = seg.f_ne(0)?.f_unsqueeze(1)?;
                    let allowed = causal()?
                        .f_unsqueeze(0)?
                        .f_logical_and(&own.f_logical_or(&prefix)?)?
                        .f_logical_and(&real_key)?
                        .f_logical_or(&eye()?.f_unsqueeze(0)?)?
                        .f_unsqueeze(1)?;
                    (on(&lanes.positions)?, Some(allowed))
                }
            };
            let x = self.run_layers(input_ids, &positions, AttnMode::Full { mask })?;
            rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)
        })
    }

    /// Logits (float32) from final hidden states (`[..., hidden]` ->
    /// `[..., vocab]`).
    pub fn logits_from_hidden(&self, hidden: &Tensor) -> Result<Tensor> {
        tch::autocast(self.opts.autocast_active(), || -> Result<Tensor> {
            let w = self.lm_head.as_ref().unwrap_or(&self.embed);
            Ok(hidden
                .f_linear(w, None::<&Tensor>)?
                .f_to_kind(Kind::Float)?)
        })
    }

    /// Logits `[B, T, vocab]` (float32) of a full forward pass; see
    /// [`Policy::hidden_states`] for the mask. Records gradients unless
    /// called under `tch::no_grad`.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let h = self.hidden_states(input_ids, attention_mask)?;
        self.logits_from_hidden(&h)
    }

    /// Logits `[B, T, vocab]` (float32) of packed rows; see
    /// [`Policy::hidden_states_packed`] for `segments`. Records gradients
    /// unless called under `tch::no_grad`.
    pub fn forward_packed(&self, input_ids: &Tensor, segments: &Tensor) -> Result<Tensor> {
        let h = self.hidden_states_packed(input_ids, segments)?;
        self.logits_from_hidden(&h)
    }

    /// Logits `[B, T, vocab]` (float32) of lanes whose sequences share
    /// prefixes: every token gets the result of an unpacked forward of its
    /// own sequence (its prefix, then its own tokens). Records gradients
    /// unless called under `tch::no_grad`.
    pub fn forward_shared(&self, input_ids: &Tensor, lanes: &SharedLanes) -> Result<Tensor> {
        let h = self.hidden(input_ids, Layout::Shared(lanes))?;
        self.logits_from_hidden(&h)
    }

    /// A forward over slots of a KV cache; logits `[A, vocab]` (float32) at
    /// each row's last new token.
    pub(crate) fn forward_cached(
        &self,
        cache: &mut KvCache,
        input_ids: &Tensor,
        plan: &CachePlan,
    ) -> Result<Tensor> {
        self.check_ids(input_ids)?;
        let positions = plan.positions.shallow_clone();
        let x = tch::autocast(self.opts.autocast_active(), || {
            self.run_layers(input_ids, &positions, AttnMode::Cached { cache, plan })
        })?;
        let hs = x.size();
        let idx = plan
            .last_index
            .f_reshape([hs[0], 1, 1])?
            .f_expand([hs[0], 1, hs[2]], false)?;
        let last = x.f_gather(1, &idx, false)?.f_squeeze_dim(1)?;
        let h = tch::autocast(self.opts.autocast_active(), || {
            rms_norm(&last, &self.norm, self.cfg.rms_norm_eps)
        })?;
        self.logits_from_hidden(&h)
    }

    /// Runs `input_ids` over slots of a KV cache only to fill the cache
    /// (no logits): prompt positions other slots then take by copy.
    pub(crate) fn fill_cached(
        &self,
        cache: &mut KvCache,
        input_ids: &Tensor,
        plan: &CachePlan,
    ) -> Result<()> {
        self.check_ids(input_ids)?;
        let positions = plan.positions.shallow_clone();
        let _hidden = tch::autocast(self.opts.autocast_active(), || {
            self.run_layers(input_ids, &positions, AttnMode::Cached { cache, plan })
        })?;
        Ok(())
    }

    /// Copies `tensors` (by Hugging Face name) into the parameters, after
    /// checking that every parameter is given with the right shape, so that
    /// a bad payload leaves the current weights untouched. Names that are not
    /// parameters are an error when `strict`, else ignored (a tied model's
    /// `lm_head.weight` is always ignored).
    pub(crate) fn assign_parameters(
        &mut self,
        tensors: &mut dyn FnMut(&str) -> Option<Result<Tensor>>,
        names_given: &[String],
        strict: bool,
    ) -> Result<()> {
        let specs = parameter_names_and_shapes(&self.cfg);
        if strict {
            let known: std::collections::HashSet<&str> =
                specs.iter().map(|(n, _)| n.as_str()).collect();
            let unknown: Vec<&String> = names_given
                .iter()
                .filter(|n| !known.contains(n.as_str()))
                .filter(|n| !(self.cfg.tie_word_embeddings && n.as_str() == "lm_head.weight"))
                .collect();
            if !unknown.is_empty() {
                return Err(PolicyError::Weights(format!(
                    "tensors that are not parameters of this model: {unknown:?}"
                )));
            }
        }
        let mut staged = Vec::with_capacity(specs.len());
        let mut missing = Vec::new();
        for (name, shape) in &specs {
            match tensors(name) {
                None => missing.push(name.clone()),
                Some(t) => {
                    let t = t?;
                    if t.size() != *shape {
                        return Err(PolicyError::Weights(format!(
                            "{name}: shape {:?}, expected {shape:?}",
                            t.size()
                        )));
                    }
                    staged.push((name.clone(), t));
                }
            }
        }
        if !missing.is_empty() {
            return Err(PolicyError::Weights(format!(
                "missing tensors: {missing:?}"
            )));
        }
        let vars = self.vs.variables();
        tch::no_grad(|| -> Result<()> {
            for (name, t) in staged {
                let mut var = vars
                    .get(&name)
                    .ok_or_else(|| PolicyError::Weights(format!("no parameter {name}")))?
                    .shallow_clone();
                var.f_copy_(&t.f_to_device(self.opts.device)?.f_to_kind(Kind::Float)?)?;
            }
            Ok(())
        })?;
        self.generation += 1;
        Ok(())
    }
}

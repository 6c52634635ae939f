//! Weights in and out: safetensors bytes (publication through an object
//! store, weight swaps) and Hugging Face model folders (`config.json`,
//! `model.safetensors` or sharded `model-0000x-of-0000y.safetensors` with
//! `model.safetensors.index.json`, `tokenizer.json`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{Value, json};
use tch::{Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::{PolicyError, Result};
use crate::model::{DeviceOptions, Policy, parameter_names_and_shapes};
use crate::tokenizer::PolicyTokenizer;

/// Name of the single-file weights of a Hugging Face folder.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Small files of a model folder that are kept and written back on save.
const EXTRA_FILES: &[&str] = &[
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// The dtype weights are serialised in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// float32: exact (the parameters are float32).
    #[default]
    F32,
    /// bfloat16: half the bytes, rounded.
    Bf16,
}

impl WeightDtype {
    fn kind(self) -> Kind {
        match self {
            WeightDtype::F32 => Kind::Float,
            WeightDtype::Bf16 => Kind::BFloat16,
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            WeightDtype::F32 => Dtype::F32,
            WeightDtype::Bf16 => Dtype::BF16,
        }
    }
}

fn kind_of(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        other => {
            return Err(PolicyError::Weights(format!(
                "tensor dtype {other:?} is not supported (float32, float16, bfloat16, float64)"
            )));
        }
    })
}

fn view_to_tensor(name: &str, view: &TensorView<'_>) -> Result<Tensor> {
    let kind = kind_of(view.dtype()).map_err(|e| PolicyError::Weights(format!("{name}: {e}")))?;
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    Ok(Tensor::f_from_data_size(view.data(), &shape, kind)?)
}

/// Serialises named tensors to safetensors bytes with the metadata
/// `{"format": "pt"}` that transformers expects. The safetensors layout
/// orders tensors by dtype alignment then name, so the same weights always
/// give the same bytes.
fn tensors_to_safetensors(tensors: &[(String, Tensor)], dtype: WeightDtype) -> Result<Vec<u8>> {
    let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t
            .f_detach()?
            .f_to_device(tch::Device::Cpu)?
            .f_to_kind(dtype.kind())?
            .f_contiguous()?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * dtype.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel)?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        buffers.push((name.clone(), shape, bytes));
    }
    let views = buffers
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(dtype.dtype(), shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|source| PolicyError::Safetensors {
                    what: name.clone(),
                    source,
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::tensor::serialize(views, Some(metadata)).map_err(|source| {
        PolicyError::Safetensors {
            what: "cannot serialise".into(),
            source,
        }
    })
}

impl Policy {
    /// The weights as safetensors bytes (Hugging Face tensor names; a tied
    /// model has no `lm_head.weight`), for publishing through an object
    /// store. Deterministic: the same weights give the same bytes.
    pub fn weights_to_safetensors(&self, dtype: WeightDtype) -> Result<Vec<u8>> {
        tensors_to_safetensors(&self.named_parameters(), dtype)
    }

    /// Replaces the weights with safetensors bytes produced by
    /// [`Policy::weights_to_safetensors`] (or any safetensors file with the
    /// same tensor names and shapes; float32/16, bfloat16 accepted) and sets
    /// the policy version. Every tensor is checked before any is copied, so
    /// an invalid payload leaves the weights as they were. Decode batches
    /// recompute their KV caches before the next token.
    pub fn load_weights_from_bytes(&mut self, bytes: &[u8], version: i32) -> Result<()> {
        let st = SafeTensors::deserialize(bytes).map_err(|source| PolicyError::Safetensors {
            what: "invalid safetensors data".into(),
            source,
        })?;
        let names: Vec<String> = st.names().into_iter().map(|n| n.to_string()).collect();
        self.assign_parameters(
            &mut |name| match st.tensor(name) {
                Ok(view) => Some(view_to_tensor(name, &view)),
                Err(_) => None,
            },
            &names,
            true,
        )?;
        self.set_version(version);
        Ok(())
    }

    /// Loads a Hugging Face model folder: `config.json` (`model_type` llama
    /// or qwen2), `model.safetensors` or the shards listed by
    /// `model.safetensors.index.json`, and `tokenizer.json` when present.
    /// The weights get version 0.
    pub fn from_pretrained(dir: &Path, opts: DeviceOptions) -> Result<Self> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let files = weight_files(dir)?;
        // Read every file (tensors are copied out, so the bytes can go after).
        let mut blobs = Vec::with_capacity(files.len());
        for f in &files {
            let path = dir.join(f);
            blobs.push((
                path.clone(),
                std::fs::read(&path).map_err(|e| PolicyError::io(&path, e))?,
            ));
        }
        let mut index: HashMap<String, (usize, TensorView<'_>)> = HashMap::new();
        let mut parsed = Vec::with_capacity(blobs.len());
        for (path, bytes) in &blobs {
            let st = SafeTensors::deserialize(bytes).map_err(|e| {
                PolicyError::Weights(format!("{}: invalid safetensors file: {e}", path.display()))
            })?;
            parsed.push(st);
        }
        for (i, st) in parsed.iter().enumerate() {
            for (name, view) in st.tensors() {
                index.insert(name, (i, view));
            }
        }
        let expected: std::collections::HashSet<String> = parameter_names_and_shapes(&cfg)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let ignored: Vec<&String> = index.keys().filter(|n| !expected.contains(*n)).collect();
        if !ignored.is_empty() {
            tracing::debug!(
                ?ignored,
                "tensors in the checkpoint that the model does not use"
            );
        }
        let mut policy = Policy::build(cfg, opts, &mut |name, _shape| {
            let (file, view) = index.get(name).ok_or_else(|| {
                PolicyError::Weights(format!(
                    "{}: tensor {name} is missing from the checkpoint",
                    dir.display()
                ))
            })?;
            view_to_tensor(name, view)
                .map_err(|e| PolicyError::Weights(format!("{}: {e}", blobs[*file].0.display())))
        })?;
        let tok_path = dir.join("tokenizer.json");
        if tok_path.is_file() {
            policy.tokenizer = Some(PolicyTokenizer::from_file(&tok_path)?);
        }
        for name in EXTRA_FILES {
            let path = dir.join(name);
            if path.is_file() {
                let bytes = std::fs::read(&path).map_err(|e| PolicyError::io(&path, e))?;
                policy.extra_files.insert((*name).to_owned(), bytes);
            }
        }
        Ok(policy)
    }

    /// Writes the model as a Hugging Face folder that transformers'
    /// `from_pretrained` opens: `config.json`, the weights in float32 (one
    /// `model.safetensors`, or shards of at most `max_shard_bytes` each with
    /// `model.safetensors.index.json`), `tokenizer.json` and the small files
    /// that came with the loaded folder (`tokenizer_config.json`,
    /// `generation_config.json`, ...). Existing weight files in `dir` that
    /// this save does not write are left alone.
    pub fn save_pretrained(&self, dir: &Path, max_shard_bytes: Option<usize>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| PolicyError::io(dir, e))?;
        let write = |name: &str, bytes: &[u8]| -> Result<()> {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(|e| PolicyError::io(&path, e))
        };
        let config = serde_json::to_vec_pretty(&self.cfg.to_hf_json())
            .map_err(|e| PolicyError::Weights(format!("config.json: {e}")))?;
        write("config.json", &config)?;
        let params = self.named_parameters();
        let shards = shard(&params, max_shard_bytes);
        if shards.len() <= 1 {
            write(
                SINGLE_FILE,
                &tensors_to_safetensors(&params, WeightDtype::F32)?,
            )?;
        } else {
            let n = shards.len();
            let mut weight_map = BTreeMap::new();
            let mut total = 0usize;
            for (i, shard) in shards.iter().enumerate() {
                let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
                let tensors: Vec<(String, Tensor)> = shard
                    .iter()
                    .map(|&j| (params[j].0.clone(), params[j].1.shallow_clone()))
                    .collect();
                for (name, t) in &tensors {
                    weight_map.insert(name.clone(), Value::String(file.clone()));
                    total += t.numel() * 4;
                }
                write(&file, &tensors_to_safetensors(&tensors, WeightDtype::F32)?)?;
            }
            let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            let index = serde_json::to_vec_pretty(&index)
                .map_err(|e| PolicyError::Weights(format!("{INDEX_FILE}: {e}")))?;
            write(INDEX_FILE, &index)?;
        }
        if let Some(tok) = &self.tokenizer {
            write("tokenizer.json", tok.json().as_bytes())?;
        }
        for (name, bytes) in &self.extra_files {
            write(name, bytes)?;
        }
        Ok(())
    }
}

/// Groups parameters (by index) into shards of at most `max` bytes
/// (float32); a single tensor larger than `max` gets a shard of its own.
fn shard(params: &[(String, Tensor)], max: Option<usize>) -> Vec<Vec<usize>> {
    let Some(max) = max else {
        return vec![(0..params.len()).collect()];
    };
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut size = 0usize;
    for (i, (_, t)) in params.iter().enumerate() {
        let bytes = t.numel() * 4;
        if !current.is_empty() && size + bytes > max {
            shards.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(i);
        size += bytes;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

/// The safetensors files of a folder: the shards named by the index file, or
/// the single file.
fn weight_files(dir: &Path) -> Result<Vec<String>> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        let text =
            std::fs::read_to_string(&index_path).map_err(|e| PolicyError::io(&index_path, e))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|source| PolicyError::json(&index_path, source))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                PolicyError::Weights(format!("{}: no `weight_map` object", index_path.display()))
            })?;
        let mut files: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                PolicyError::Weights(format!(
                    "{}: weight_map[{name:?}] is not a file name",
                    index_path.display()
                ))
            })?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(PolicyError::Weights(format!(
                    "{}: weight_map[{name:?}] = {file:?} is not a plain file name",
                    index_path.display()
                )));
            }
            if !files.iter().any(|f| f == file) {
                files.push(file.to_owned());
            }
        }
        files.sort();
        return Ok(files);
    }
    if dir.join(SINGLE_FILE).is_file() {
        return Ok(vec![SINGLE_FILE.to_owned()]);
    }
    Err(PolicyError::Weights(format!(
        "{}: neither {SINGLE_FILE} nor {INDEX_FILE} found",
        dir.display()
    )))
}

//! The model registry: one table from a checkpoint's architecture (GGUF
//! `general.architecture`, `config.json` `model_type`) to its loaders, and
//! [`load`], which reads a checkpoint (a GGUF file, or a folder with
//! `config.json`, safetensors weights and `tokenizer.json`) into a model,
//! its tokenizer and its chat template.
//!
//! Adding a family is a row of [`ARCHITECTURES`] and the loaders it names.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{bail, DType, Device, Error, Result};
use candle_nn::VarBuilder;

use super::limits::read_gguf;
use super::quantized_gemma3::QuantizedGemma3;
use super::quantized_llama::QuantizedLlama;
use super::{gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3, PagedModel, PagedOptions};
use crate::text::chat::ChatTemplate;
use crate::text::hub::{self, CheckpointFiles, SafetensorsFiles};
use crate::text::tokenizer::ModelTokenizer;

const OP: &str = "models::load";

/// Loads GGUF content `ct` (read from `file`) onto `device` with paging
/// options, dequantized to `dtype` or not, activations in `dtype`.
type GgufLoader = fn(
    ct: &gguf_file::Content,
    file: &mut File,
    device: &Device,
    options: PagedOptions,
    dequantize: bool,
    dtype: DType,
) -> Result<Box<dyn PagedModel>>;

/// Loads a model from the text of its `config.json` and its weights.
type SafetensorsLoader =
    fn(config: &str, vb: VarBuilder, options: PagedOptions) -> Result<Box<dyn PagedModel>>;

/// One architecture the crate runs.
#[derive(Clone, Copy, Debug)]
pub struct Architecture {
    /// The family's name (GGUF `general.architecture` when it loads from
    /// GGUF).
    pub name: &'static str,
    /// The `config.json` `model_type`s it loads from safetensors.
    pub model_types: &'static [&'static str],
    gguf: Option<GgufLoader>,
    safetensors: Option<SafetensorsLoader>,
}

impl Architecture {
    /// Whether it loads from GGUF files.
    pub fn loads_gguf(&self) -> bool {
        self.gguf.is_some()
    }

    /// Whether it loads from safetensors checkpoints.
    pub fn loads_safetensors(&self) -> bool {
        self.safetensors.is_some()
    }
}

/// Every architecture the crate runs.
pub const ARCHITECTURES: &[Architecture] = &[
    Architecture {
        name: "llama",
        model_types: &["llama"],
        gguf: Some(gguf_llama),
        safetensors: Some(safetensors_llama),
    },
    Architecture {
        name: "mistral",
        model_types: &["mistral"],
        gguf: None,
        safetensors: Some(safetensors_mistral),
    },
    Architecture {
        name: "qwen2",
        model_types: &["qwen2"],
        gguf: Some(gguf_llama),
        safetensors: Some(safetensors_qwen2),
    },
    Architecture {
        name: "qwen3",
        model_types: &["qwen3"],
        gguf: Some(gguf_llama),
        safetensors: Some(safetensors_qwen3),
    },
    Architecture {
        name: "phi3",
        model_types: &["phi3"],
        gguf: Some(gguf_llama),
        safetensors: Some(safetensors_phi3),
    },
    Architecture {
        name: "gemma2",
        model_types: &["gemma2"],
        gguf: None,
        safetensors: Some(safetensors_gemma2),
    },
    Architecture {
        name: "gemma3",
        model_types: &["gemma3", "gemma3_text"],
        gguf: Some(gguf_gemma3),
        safetensors: Some(safetensors_gemma3),
    },
];

/// The GGUF loader of `llama`, `qwen2`, `qwen3` and `phi3`: one decoder, the
/// family read from `general.architecture` ([`GgufFamily`]).
///
/// [`GgufFamily`]: super::quantized_llama::GgufFamily
fn gguf_llama(
    ct: &gguf_file::Content,
    file: &mut File,
    device: &Device,
    options: PagedOptions,
    dequantize: bool,
    dtype: DType,
) -> Result<Box<dyn PagedModel>> {
    let m = QuantizedLlama::from_gguf_with_dtype(ct, file, device, options, dequantize, dtype)?;
    Ok(Box::new(m))
}

fn gguf_gemma3(
    ct: &gguf_file::Content,
    file: &mut File,
    device: &Device,
    options: PagedOptions,
    dequantize: bool,
    dtype: DType,
) -> Result<Box<dyn PagedModel>> {
    Ok(match dequantize {
        true if dtype != DType::F32 => bail!(
            "{OP}: GGUF Gemma 3 runs dequantized in f32 only, not {dtype:?} (keep the weights quantized for {dtype:?})"
        ),
        true => Box::new(QuantizedGemma3::from_gguf_dequantized(ct, file, device, options)?),
        false => Box::new(QuantizedGemma3::from_gguf_with_dtype(
            ct, file, device, options, dtype,
        )?),
    })
}

fn parse<T: serde::de::DeserializeOwned>(config: &str) -> Result<T> {
    serde_json::from_str(config).map_err(|e| Error::Msg(format!("{OP}: config.json: {e}")))
}

fn safetensors_llama(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    let cfg: llama::LlamaConfig = parse(config)?;
    Ok(Box::new(llama::Llama::load(
        vb,
        &cfg.into_config(false),
        options,
    )?))
}

/// A family's config parsed from `config` and its model loaded by `load`.
fn safetensors_with<C: serde::de::DeserializeOwned, M: PagedModel + 'static>(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
    load: fn(VarBuilder, &C, PagedOptions) -> Result<M>,
) -> Result<Box<dyn PagedModel>> {
    Ok(Box::new(load(vb, &parse(config)?, options)?))
}

fn safetensors_mistral(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    safetensors_with(config, vb, options, mistral::load)
}

fn safetensors_qwen2(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    safetensors_with(config, vb, options, qwen2::load)
}

fn safetensors_qwen3(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    safetensors_with(config, vb, options, qwen3::load)
}

fn safetensors_phi3(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    safetensors_with(config, vb, options, phi3::load)
}

fn safetensors_gemma2(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    Ok(Box::new(gemma2::Gemma2::load(
        vb,
        &parse(config)?,
        options,
    )?))
}

fn safetensors_gemma3(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<Box<dyn PagedModel>> {
    Ok(Box::new(gemma3::Gemma3::load(
        vb,
        &parse(config)?,
        options,
    )?))
}

/// Whether GGUF weights are dequantized at load time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dequantize {
    /// On the CPU, when the file has Q4_0 or Q4_1 weights and their f32
    /// copies take at most half the memory available ([`auto_dequantize`]).
    #[default]
    Auto,
    /// Always (dense matmuls in the activation dtype).
    Always,
    /// Never (quantized matmuls).
    Never,
}

/// How [`load`] reads a checkpoint.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Block size and KV cache dtype of every attention layer.
    pub paged: PagedOptions,
    /// Activation (and safetensors weight) dtype: f32, or on CUDA bf16/f16.
    pub dtype: DType,
    /// GGUF weights: dequantized or kept quantized.
    pub dequantize: Dequantize,
    /// A `tokenizer.json` to use instead of the checkpoint's tokenizer.
    pub tokenizer: Option<std::path::PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            paged: PagedOptions::default(),
            dtype: DType::F32,
            dequantize: Dequantize::Auto,
            tokenizer: None,
        }
    }
}

/// A loaded checkpoint.
pub struct Loaded {
    /// The model.
    pub model: Box<dyn PagedModel>,
    /// Its tokenizer and special tokens (with the checkpoint's chat
    /// template source, if any).
    pub tokenizer: ModelTokenizer,
    /// A name for messages: GGUF `general.name`, or the folder and
    /// `model_type`.
    pub name: String,
    /// The architecture's row in [`ARCHITECTURES`].
    pub architecture: &'static Architecture,
    /// What the loader decided that the caller may want to print (why the
    /// GGUF weights were or were not dequantized).
    pub notes: Vec<String>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("name", &self.name)
            .field("architecture", &self.architecture.name)
            .field("notes", &self.notes)
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// The chat template: `source` when given (a `--chat-template` file's
    /// text, say), else the checkpoint's; compiled with the checkpoint's
    /// BOS and EOS texts. `None` when there is neither.
    pub fn chat_template(&self, source: Option<&str>) -> Result<Option<ChatTemplate>> {
        let tok = &self.tokenizer;
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
        source
            .or(tok.chat_template.as_deref())
            .map(|s| ChatTemplate::new(s, &text(tok.special.bos), &text(tok.special.eos)))
            .transpose()
    }
}

/// The architecture whose GGUF name is `name`.
fn gguf_architecture(name: &str) -> Result<&'static Architecture> {
    match ARCHITECTURES
        .iter()
        .find(|a| a.name == name && a.loads_gguf())
    {
        Some(a) => Ok(a),
        None => {
            let known: Vec<&str> = ARCHITECTURES
                .iter()
                .filter(|a| a.loads_gguf())
                .map(|a| a.name)
                .collect();
            bail!(
                "{OP}: GGUF architecture {name} is not supported ({})",
                known.join(", ")
            )
        }
    }
}

/// The architecture whose `config.json` `model_type` is `model_type`.
fn safetensors_architecture(model_type: &str) -> Result<&'static Architecture> {
    let found = ARCHITECTURES
        .iter()
        .find(|a| a.loads_safetensors() && a.model_types.contains(&model_type));
    match found {
        Some(a) => Ok(a),
        None => {
            let known: Vec<&str> = ARCHITECTURES
                .iter()
                .filter(|a| a.loads_safetensors())
                .flat_map(|a| a.model_types.iter().copied())
                .collect();
            bail!(
                "{OP}: model_type {model_type} is not supported ({})",
                known.join(", ")
            )
        }
    }
}

/// Loads the checkpoint at `path` (a GGUF file, or a folder of a
/// safetensors checkpoint as [`hub::checkpoint_files`] finds it) onto
/// `device`.
///
/// GGUF files are read through [`read_gguf`] (checked before candle's
/// reader); the architecture comes from `general.architecture` or
/// `model_type` (`llama` when a `config.json` has none), through
/// [`ARCHITECTURES`].
pub fn load(path: &Path, device: &Device, options: &LoadOptions) -> Result<Loaded> {
    match hub::checkpoint_files(path)? {
        CheckpointFiles::Gguf(file) => load_gguf(&file, device, options),
        CheckpointFiles::Safetensors(files) => load_safetensors(&files, device, options),
    }
}

fn load_gguf(path: &Path, device: &Device, options: &LoadOptions) -> Result<Loaded> {
    let opening = |e: std::io::Error| Error::Msg(format!("{OP}: opening {}: {e}", path.display()));
    let mut file = File::open(path).map_err(opening)?;
    let ct = read_gguf(&mut file)
        .map_err(|e| Error::Msg(format!("{OP}: reading {}: {e}", path.display())))?;
    let arch_name = match ct.metadata.get("general.architecture") {
        Some(v) => v.to_string()?.clone(),
        None => bail!("{OP}: {} has no general.architecture", path.display()),
    };
    let architecture = gguf_architecture(&arch_name)?;
    let mut tokenizer = ModelTokenizer::from_gguf(&ct)?;
    if let Some(p) = &options.tokenizer {
        tokenizer.tokenizer = tokenizers::Tokenizer::from_file(p)
            .map_err(|e| Error::Msg(format!("{OP}: loading the tokenizer {}: {e}", p.display())))?;
    }
    let name = ct
        .metadata
        .get("general.name")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| path.display().to_string());
    let (dequantize, note) = match options.dequantize {
        Dequantize::Always => (true, None),
        Dequantize::Never => (false, None),
        Dequantize::Auto => auto_dequantize(&ct, device),
    };
    let Some(loader) = architecture.gguf else {
        bail!("{OP}: {arch_name} has no GGUF loader");
    };
    let model = loader(
        &ct,
        &mut file,
        device,
        options.paged,
        dequantize,
        options.dtype,
    )?;
    Ok(Loaded {
        model,
        tokenizer,
        name,
        architecture,
        notes: note.into_iter().collect(),
    })
}

fn load_safetensors(
    files: &SafetensorsFiles,
    device: &Device,
    options: &LoadOptions,
) -> Result<Loaded> {
    let dir = files.dir.as_path();
    let config = std::fs::read_to_string(&files.config)
        .map_err(|e| Error::Msg(format!("{OP}: reading {}: {e}", files.config.display())))?;
    // SAFETY: the files are not modified while the model is loaded (the
    // mapping is read-only; a file changed under it is the caller's bug).
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, options.dtype, device)? };
    let (model, architecture) = load_config(&config, vb, options.paged)?;
    let model_type = architecture_model_type(&config)?;
    let tokenizer = ModelTokenizer::from_dir(dir, options.tokenizer.as_deref())?;
    Ok(Loaded {
        model,
        tokenizer,
        name: format!("{} ({model_type})", dir.display()),
        architecture,
        notes: Vec::new(),
    })
}

/// The `model_type` of a `config.json` text (`llama` when it has none).
fn architecture_model_type(config: &str) -> Result<String> {
    let json: serde_json::Value = parse(config)?;
    Ok(json["model_type"].as_str().unwrap_or("llama").to_string())
}

/// Loads the model that `config` (a `config.json` text) describes from the
/// weights in `vb`, through the [`ARCHITECTURES`] row of its `model_type`
/// (`llama` when it has none); returns the model and its row.
pub fn load_config(
    config: &str,
    vb: VarBuilder,
    options: PagedOptions,
) -> Result<(Box<dyn PagedModel>, &'static Architecture)> {
    let model_type = architecture_model_type(config)?;
    let architecture = safetensors_architecture(&model_type)?;
    let Some(loader) = architecture.safetensors else {
        bail!("{OP}: {model_type} has no safetensors loader");
    };
    Ok((loader(config, vb, options)?, architecture))
}

pub use super::kv_cache::host_memory_available;

/// [`Dequantize::Auto`]: whether GGUF content `ct` is dequantized on
/// `device`, and a note saying why. Dequantized on the CPU when the file
/// has Q4_0 or Q4_1 weights (candle's CPU matmuls of these are quantized
/// dot products, slower than f32 matmuls for prompts and batches) and the
/// f32 weights take at most half the memory available; kept quantized
/// otherwise.
pub fn auto_dequantize(ct: &gguf_file::Content, device: &Device) -> (bool, Option<String>) {
    if !device.is_cpu() {
        return (false, None);
    }
    let q4 = ct
        .tensor_infos
        .values()
        .find(|t| matches!(t.ggml_dtype, GgmlDType::Q4_0 | GgmlDType::Q4_1));
    let Some(q4) = q4 else {
        return (false, None);
    };
    let f32_bytes: usize = ct
        .tensor_infos
        .values()
        .map(|t| t.shape.elem_count().saturating_mul(4))
        .fold(0, usize::saturating_add);
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    match host_memory_available() {
        Some(avail) if f32_bytes > avail / 2 => (
            false,
            Some(format!(
                "keeping the {:?} weights quantized: as f32 they would take {:.0} MiB, more than half the {:.0} MiB available",
                q4.ggml_dtype,
                mib(f32_bytes),
                mib(avail)
            )),
        ),
        _ => (
            true,
            Some(format!(
                "dequantizing the {:?} weights to f32 ({:.0} MiB): faster on the CPU",
                q4.ggml_dtype,
                mib(f32_bytes)
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_name_belongs_to_one_architecture() {
        let mut names: Vec<&str> = ARCHITECTURES.iter().map(|a| a.name).collect();
        let mut types: Vec<&str> = ARCHITECTURES
            .iter()
            .flat_map(|a| a.model_types.iter().copied())
            .collect();
        let (n, t) = (names.len(), types.len());
        names.sort();
        names.dedup();
        types.sort();
        types.dedup();
        assert_eq!((names.len(), types.len()), (n, t));
    }

    #[test]
    fn unknown_architectures_are_named_with_the_known_ones() {
        let e = gguf_architecture("phi2").unwrap_err().to_string();
        assert_eq!(
            e.lines().next(),
            Some("models::load: GGUF architecture phi2 is not supported (llama, qwen2, qwen3, phi3, gemma3)")
        );
        let e = safetensors_architecture("phi").unwrap_err().to_string();
        assert_eq!(
            e.lines().next(),
            Some("models::load: model_type phi is not supported (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, gemma3_text)")
        );
        for family in ["mistral", "qwen2", "qwen3", "phi3"] {
            assert_eq!(safetensors_architecture(family).unwrap().name, family);
        }
    }
}

//! The tokenizer of a Hugging Face model directory.

use std::path::Path;

use candle_core::{bail, Error, Result};
use serde_json::Value;
use tokenizers::Tokenizer;

use super::{ModelTokenizer, SpecialTokens, OP};

/// Reads `path` as JSON, or `None` when the file does not exist.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => bail!("{OP}: reading {}: {e}", path.display()),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::msg(format!("{OP}: parsing {}: {e}", path.display())))
}

/// A special token of `tokenizer_config.json`: a string or
/// `{"content": ...}`.
fn token_string(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

/// `eos_token_id` of a config: a number or a list of numbers.
fn id_list(config: Option<&Value>, key: &str) -> Vec<u32> {
    match config.and_then(|c| c.get(key)) {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// The chat template of the directory: `chat_template.jinja`, then
/// `chat_template.json`'s `chat_template`, then `tokenizer_config.json`'s
/// (a string or a list of `{name, template}` whose `default` is taken).
fn chat_template(dir: &Path, config: Option<&Value>) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(t) => return Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => bail!("{OP}: reading {}: {e}", jinja.display()),
    }
    let json = read_json(&dir.join("chat_template.json"))?;
    let Some(t) = json
        .as_ref()
        .or(config)
        .and_then(|c| c.get("chat_template"))
    else {
        return Ok(None);
    };
    match t {
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => {
            let named = |name: &str| {
                list.iter().find_map(|e| {
                    (e.get("name").and_then(Value::as_str) == Some(name))
                        .then(|| e.get("template").and_then(Value::as_str))
                        .flatten()
                })
            };
            match named("default") {
                Some(s) => Ok(Some(s.to_string())),
                None => bail!(
                    "{OP}: the chat_template list of {} has no template named default",
                    dir.display()
                ),
            }
        }
        other => bail!(
            "{OP}: chat_template in {} is neither a string nor a list: {other}",
            dir.display()
        ),
    }
}

/// See [`ModelTokenizer::from_dir`].
pub(super) fn from_dir(dir: &Path, tokenizer: Option<&Path>) -> Result<ModelTokenizer> {
    let path = tokenizer.map_or_else(|| dir.join("tokenizer.json"), Path::to_path_buf);
    let tok = Tokenizer::from_file(&path)
        .map_err(|e| Error::msg(format!("{OP}: loading {}: {e}", path.display())))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?;
    let generation = read_json(&dir.join("generation_config.json"))?;
    let model = read_json(&dir.join("config.json"))?;
    let named = |key: &str| -> Option<u32> {
        config
            .as_ref()
            .and_then(|c| c.get(key))
            .and_then(token_string)
            .and_then(|t| tok.token_to_id(t))
    };
    let first_id = |key: &str| {
        [generation.as_ref(), model.as_ref()]
            .into_iter()
            .find_map(|c| id_list(c, key).first().copied())
    };
    let bos = named("bos_token").or_else(|| first_id("bos_token_id"));
    let eos = named("eos_token").or_else(|| first_id("eos_token_id"));
    // What tokenizer.json's post-processor adds, where the config is silent.
    let added = |flag: &str| -> Result<bool> {
        if let Some(b) = config
            .as_ref()
            .and_then(|c| c.get(flag))
            .and_then(Value::as_bool)
        {
            return Ok(b);
        }
        let with = tok
            .encode("a", true)
            .map_err(|e| Error::msg(format!("{OP}: encoding a probe: {e}")))?;
        let without = tok
            .encode("a", false)
            .map_err(|e| Error::msg(format!("{OP}: encoding a probe: {e}")))?;
        let (with, without) = (with.get_ids(), without.get_ids());
        Ok(match flag {
            "add_bos_token" => {
                with.len() > without.len() && bos.is_some() && with.first() == bos.as_ref()
            }
            _ => with.len() > without.len() && eos.is_some() && with.last() == eos.as_ref(),
        })
    };
    let mut special = SpecialTokens {
        bos,
        eos,
        add_bos: added("add_bos_token")?,
        add_eos: added("add_eos_token")?,
        stop: Vec::new(),
    };
    let mut extra = id_list(generation.as_ref(), "eos_token_id");
    extra.extend(id_list(model.as_ref(), "eos_token_id"));
    special.collect_stop(&tok, extra);
    Ok(ModelTokenizer {
        tokenizer: tok,
        special,
        chat_template: chat_template(dir, config.as_ref())?,
    })
}

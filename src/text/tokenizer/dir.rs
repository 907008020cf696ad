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

/// The token ids at `key` of the config file `file` (`eos_token_id`: a
/// number or a list of numbers; absent or `null` is none), each checked to
/// be a token of `tok`: an id that is not a number, or that the vocabulary
/// lacks, is an error naming the file, the key and the value.
fn id_list(file: &str, config: Option<&Value>, key: &str, tok: &Tokenizer) -> Result<Vec<u32>> {
    let one = |v: &Value| -> Result<u32> {
        let Some(id) = v.as_u64().and_then(|v| u32::try_from(v).ok()) else {
            bail!("{OP}: {file} {key} = {v} is not a token id");
        };
        if tok.id_to_token(id).is_none() {
            bail!(
                "{OP}: {file} {key} = {id} is not in the vocabulary of {} tokens",
                tok.get_vocab_size(true)
            );
        }
        Ok(id)
    };
    match config.and_then(|c| c.get(key)) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().filter(|v| !v.is_null()).map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
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

/// Checks what `tokenizers` 0.23 assumes of a BPE model's merges without
/// checking it before it slices: with a `continuing_subword_prefix`, the
/// second piece of every merge starts with it (building the model
/// subtracted the prefix's length from the piece's: a shorter piece
/// panicked), and every merge's joined piece is in the vocabulary (it was
/// copied into a buffer as long as the longest token first: a longer one
/// panicked). A merge that breaks either is an error naming it.
fn check_bpe_merges(path: &Path, json: &Value) -> Result<()> {
    let Some(model) = json.get("model") else {
        return Ok(());
    };
    let (Some(vocab), Some(merges)) = (
        model.get("vocab").and_then(Value::as_object),
        model.get("merges").and_then(Value::as_array),
    ) else {
        return Ok(());
    };
    let prefix = match model.get("continuing_subword_prefix") {
        Some(Value::String(p)) => p.as_str(),
        _ => "",
    };
    let legacy = merges
        .iter()
        .filter(|m| !m.as_str().is_some_and(|s| s.starts_with("#version")));
    for (i, m) in legacy.enumerate() {
        let (a, b) = match m {
            Value::String(s) => match s.split(' ').collect::<Vec<_>>().as_slice() {
                [a, b] => (*a, *b),
                // tokenizers refuses it (BadMerges).
                _ => continue,
            },
            Value::Array(pair) => match (
                pair.first().and_then(Value::as_str),
                pair.get(1).and_then(Value::as_str),
            ) {
                (Some(a), Some(b)) => (a, b),
                _ => continue,
            },
            _ => continue,
        };
        let Some(rest) = b.strip_prefix(prefix) else {
            bail!(
                "{OP}: {}: merge {i} joins {b:?}, which does not start with the model's continuing_subword_prefix {prefix:?}",
                path.display()
            );
        };
        let joined = format!("{a}{rest}");
        if !vocab.contains_key(&joined) {
            bail!(
                "{OP}: {}: merge {i} joins {a:?} and {b:?} into {joined:?}, which is not in the vocabulary",
                path.display()
            );
        }
    }
    Ok(())
}

/// See [`ModelTokenizer::from_dir`].
pub(super) fn from_dir(dir: &Path, tokenizer: Option<&Path>) -> Result<ModelTokenizer> {
    let path = tokenizer.map_or_else(|| dir.join("tokenizer.json"), Path::to_path_buf);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => bail!("{OP}: reading {}: {e}", path.display()),
    };
    // The file must be JSON before `tokenizers` reads it: its decoder
    // field's deserializer panics (`expect("Helper")`) on malformed JSON
    // inside it, where valid JSON of any shape is an error.
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| Error::msg(format!("{OP}: parsing {}: {e}", path.display())))?;
    check_bpe_merges(&path, &json)?;
    let tok: Tokenizer = text
        .parse()
        .map_err(|e| Error::msg(format!("{OP}: loading {}: {e}", path.display())))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?;
    let generation = read_json(&dir.join("generation_config.json"))?;
    let model = read_json(&dir.join("config.json"))?;
    // A token tokenizer_config.json names must be in the vocabulary.
    let named = |key: &str| -> Result<Option<u32>> {
        let Some(t) = config
            .as_ref()
            .and_then(|c| c.get(key))
            .and_then(token_string)
        else {
            return Ok(None);
        };
        match tok.token_to_id(t) {
            Some(id) => Ok(Some(id)),
            None => bail!(
                "{OP}: tokenizer_config.json {key} = {t:?} is not a token of the vocabulary of {} tokens",
                tok.get_vocab_size(true)
            ),
        }
    };
    let first_id = |key: &str| -> Result<Option<u32>> {
        for (file, c) in [
            ("generation_config.json", generation.as_ref()),
            ("config.json", model.as_ref()),
        ] {
            if let Some(&id) = id_list(file, c, key, &tok)?.first() {
                return Ok(Some(id));
            }
        }
        Ok(None)
    };
    let bos = match named("bos_token")? {
        Some(id) => Some(id),
        None => first_id("bos_token_id")?,
    };
    let eos = match named("eos_token")? {
        Some(id) => Some(id),
        None => first_id("eos_token_id")?,
    };
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
    let mut extra = id_list(
        "generation_config.json",
        generation.as_ref(),
        "eos_token_id",
        &tok,
    )?;
    extra.extend(id_list(
        "config.json",
        model.as_ref(),
        "eos_token_id",
        &tok,
    )?);
    special.collect_stop(&tok, extra);
    Ok(ModelTokenizer {
        tokenizer: tok,
        special,
        chat_template: chat_template(dir, config.as_ref())?,
    })
}

#[cfg(test)]
mod tests {
    use tokenizers::models::wordlevel::WordLevel;

    use super::*;

    /// A folder holding a two-token `tokenizer.json` (`a`, `b`) and
    /// `files`, removed on drop.
    struct Dir(std::path::PathBuf);

    impl Dir {
        fn new(tag: &str, files: &[(&str, &str)]) -> Self {
            let dir = std::env::temp_dir().join(format!("cpa-dir-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let model = WordLevel::builder()
                .vocab(
                    [("a".to_string(), 0), ("b".to_string(), 1)]
                        .into_iter()
                        .collect(),
                )
                .unk_token("a".into())
                .build()
                .unwrap();
            Tokenizer::new(model)
                .save(dir.join("tokenizer.json"), false)
                .unwrap();
            for (name, text) in files {
                std::fs::write(dir.join(name), text).unwrap();
            }
            Self(dir)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn special_token_ids_outside_the_vocabulary_are_refused_at_load() {
        let ok = Dir::new(
            "ok",
            &[(
                "config.json",
                r#"{"bos_token_id": 1, "eos_token_id": [0, null]}"#,
            )],
        );
        let tok = from_dir(&ok.0, None).unwrap();
        assert_eq!((tok.special.bos, tok.special.eos), (Some(1), Some(0)));
        for (tag, file, text, want) in [
            (
                "bos",
                "config.json",
                r#"{"bos_token_id": 4000000000}"#,
                "tokenizer: config.json bos_token_id = 4000000000 is not in the vocabulary of 2 tokens",
            ),
            (
                "eos",
                "generation_config.json",
                r#"{"eos_token_id": [1, 2]}"#,
                "tokenizer: generation_config.json eos_token_id = 2 is not in the vocabulary of 2 tokens",
            ),
            (
                "neg",
                "config.json",
                r#"{"eos_token_id": -1}"#,
                "tokenizer: config.json eos_token_id = -1 is not a token id",
            ),
            (
                "big",
                "config.json",
                r#"{"bos_token_id": 1e10}"#,
                "tokenizer: config.json bos_token_id = 10000000000.0 is not a token id",
            ),
            (
                "named",
                "tokenizer_config.json",
                r#"{"bos_token": "<s>"}"#,
                "tokenizer: tokenizer_config.json bos_token = \"<s>\" is not a token of the vocabulary of 2 tokens",
            ),
        ] {
            let dir = Dir::new(tag, &[(file, text)]);
            let err = from_dir(&dir.0, None).unwrap_err().to_string();
            // The message's first line: no backtrace.
            assert_eq!(err.lines().next(), Some(want), "{tag}");
        }
    }

    #[test]
    fn tokenizer_json_that_panicked_tokenizers_is_an_error() {
        let bpe = |prefix: &str, decoder: &str| {
            format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":{decoder},"model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":{prefix},"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"vocab":{{"a":0,"b":1,"ab":2}},"merges":["a b"]}}}}"#
            )
        };
        let ok = Dir::new("bpe-ok", &[]);
        std::fs::write(ok.0.join("tokenizer.json"), bpe("null", "null")).unwrap();
        let tok = from_dir(&ok.0, None).unwrap();
        assert_eq!(tok.tokenizer.encode("ab", false).unwrap().get_ids(), [2]);
        // A continuing_subword_prefix longer than a merge's second piece:
        // tokenizers subtracted the lengths and panicked.
        std::fs::write(ok.0.join("tokenizer.json"), bpe("\"####\"", "null")).unwrap();
        let err = from_dir(&ok.0, None).unwrap_err().to_string();
        assert_eq!(
            err.lines().next().unwrap(),
            format!(
                "tokenizer: {}: merge 0 joins \"b\", which does not start with the model's continuing_subword_prefix \"####\"",
                ok.0.join("tokenizer.json").display()
            )
        );
        // A merge whose joined piece is longer than every token: it was
        // copied into a buffer of the longest token's length, which panicked.
        std::fs::write(
            ok.0.join("tokenizer.json"),
            bpe("null", "null").replace(r#"["a b"]"#, r#"["ab ab"]"#),
        )
        .unwrap();
        let err = from_dir(&ok.0, None).unwrap_err().to_string();
        assert_eq!(
            err.lines().next().unwrap(),
            format!(
                "tokenizer: {}: merge 0 joins \"ab\" and \"ab\" into \"abab\", which is not in the vocabulary",
                ok.0.join("tokenizer.json").display()
            )
        );
        // Malformed JSON inside the decoder: tokenizers' decoder
        // deserializer panicked (expect("Helper")).
        std::fs::write(
            ok.0.join("tokenizer.json"),
            bpe("null", r#"{"type":"ByteLevel",}"#),
        )
        .unwrap();
        let err = from_dir(&ok.0, None).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "tokenizer: parsing {}: trailing comma",
                ok.0.join("tokenizer.json").display()
            )),
            "{err}"
        );
    }
}

//! Which files of a checkpoint to load or download: one GGUF file, or a
//! safetensors directory (`config.json`, `tokenizer.json`,
//! `tokenizer_config.json` and the weights: the shards that
//! `model.safetensors.index.json` names, or `model.safetensors`).
//!
//! The same rules serve a local directory ([`checkpoint_files`]), a snapshot
//! of the Hugging Face hub cache ([`cached_snapshot`]) and, with the `hub`
//! feature, a download from the hub (`download`, with progress bars).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::{bail, Result};

/// The index of a sharded safetensors checkpoint.
pub const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// The files of a checkpoint to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointFiles {
    /// A GGUF file: weights, tokenizer and chat template in one.
    Gguf(PathBuf),
    /// A safetensors directory.
    Safetensors(SafetensorsFiles),
}

/// The files of a safetensors checkpoint, all in `dir`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetensorsFiles {
    /// The directory (`config.json`, tokenizer files and weights).
    pub dir: PathBuf,
    /// `config.json`.
    pub config: PathBuf,
    /// `tokenizer.json`, if present.
    pub tokenizer: Option<PathBuf>,
    /// `tokenizer_config.json` (chat template, BOS/EOS), if present.
    pub tokenizer_config: Option<PathBuf>,
    /// The weight files, in order: the shards of
    /// `model.safetensors.index.json` (sorted, each once) when there is an
    /// index, else `model.safetensors`, else every `*.safetensors` of `dir`
    /// (sorted).
    pub weights: Vec<PathBuf>,
}

/// The files besides `tokenizer.json` that a safetensors checkpoint's
/// tokenizer is loaded with, when the repository has them: special tokens
/// and the chat template (`tokenizer_config.json`), stop tokens
/// (`generation_config.json`) and a chat template of its own.
pub const TOKENIZER_FILES: [&str; 4] = [
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Checks that `name`, the value of `what`, is a relative path that stays
/// inside the folder it is joined to: not empty, not absolute, no `\\`, NUL
/// or empty component, and no `.` or `..` component (`Q4/model.gguf` is
/// fine, `../model.gguf`, `/etc/passwd` and `a//b` are not). Names from a
/// repository listing, an index file or the command line are checked so
/// before they are joined to a snapshot or download folder.
pub fn check_relative_name(what: &str, name: &str) -> Result<()> {
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name.starts_with('/') || Path::new(name).is_absolute() {
        Some("it is an absolute path")
    } else if name.contains('\\') || name.contains('\0') {
        Some("it holds a backslash or NUL")
    } else if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        Some("it has an empty, `.` or `..` component")
    } else {
        None
    };
    match why {
        Some(why) => bail!("hub: {what} {name:?} would leave its folder: {why}"),
        None => Ok(()),
    }
}

/// Checks that `commit` (what `source` names: a ref file or the revision
/// itself) is one folder name (a commit hash): ASCII letters, digits, `-`,
/// `_` and `.`, not empty, not `.` or `..`.
fn check_commit(source: &str, commit: &str) -> Result<()> {
    if commit.is_empty()
        || commit == "."
        || commit == ".."
        || !commit
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        bail!(
            "hub: {source} holds {commit:?}, not a commit hash (one folder name of letters, digits, -, _ and .)"
        );
    }
    Ok(())
}

/// What to download from a repository, from its file listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RepoPlan {
    /// One GGUF file.
    Gguf(String),
    /// A safetensors checkpoint: `files` (config, tokenizer files and, when
    /// there is no index, the weights), then the shards named by `index`.
    Safetensors {
        /// Files to download first, in order.
        files: Vec<String>,
        /// `model.safetensors.index.json`, whose shards follow.
        index: Option<String>,
    },
}

/// Chooses what to download from a repository whose files (paths relative
/// to its root, as the hub lists them) are `listing`.
///
/// * `gguf_file` given: that file, which must be listed.
/// * A `config.json` and safetensors weights: a safetensors checkpoint
///   (`tokenizer.json` required, the [`TOKENIZER_FILES`] that are listed;
///   the index when listed, else `model.safetensors`, else every top-level
///   `*.safetensors`).
/// * Otherwise the repository's one top-level `.gguf` file; several are an
///   error that lists them.
pub fn files_to_download(listing: &[String], gguf_file: Option<&str>) -> Result<RepoPlan> {
    let has = |name: &str| listing.iter().any(|f| f == name);
    if let Some(f) = gguf_file {
        check_relative_name("model file", f)?;
        if !has(f) {
            bail!(
                "hub: the repository has no file {f} (its GGUF files: {})",
                list_or_none(&gguf_names(listing))
            );
        }
        return Ok(RepoPlan::Gguf(f.to_string()));
    }
    let shards: Vec<&String> = listing
        .iter()
        .filter(|f| !f.contains('/') && f.ends_with(".safetensors"))
        .collect();
    if has("config.json") && (has(SAFETENSORS_INDEX) || !shards.is_empty()) {
        if !has("tokenizer.json") {
            bail!(
                "hub: the repository has config.json and safetensors weights but no tokenizer.json"
            );
        }
        let mut files = vec!["config.json".to_string(), "tokenizer.json".to_string()];
        // What the tokenizer loader reads besides tokenizer.json: special
        // tokens, stop tokens and the chat template.
        for optional in TOKENIZER_FILES {
            if has(optional) {
                files.push(optional.to_string());
            }
        }
        if has(SAFETENSORS_INDEX) {
            return Ok(RepoPlan::Safetensors {
                files,
                index: Some(SAFETENSORS_INDEX.to_string()),
            });
        }
        if has("model.safetensors") {
            files.push("model.safetensors".to_string());
        } else {
            let mut shards: Vec<String> = shards.into_iter().cloned().collect();
            for s in &shards {
                check_relative_name("listed weight file", s)?;
            }
            shards.sort();
            files.extend(shards);
        }
        return Ok(RepoPlan::Safetensors { files, index: None });
    }
    let ggufs = gguf_names(listing);
    match ggufs.as_slice() {
        [one] => {
            check_relative_name("listed GGUF file", one)?;
            Ok(RepoPlan::Gguf(one.clone()))
        }
        [] => bail!(
            "hub: the repository has neither a GGUF file nor config.json with safetensors weights"
        ),
        _ => bail!(
            "hub: the repository has {} GGUF files, name the one to load: {}",
            ggufs.len(),
            ggufs.join(", ")
        ),
    }
}

/// The top-level `.gguf` files of `listing`, sorted.
fn gguf_names(listing: &[String]) -> Vec<String> {
    let mut names: Vec<String> = listing
        .iter()
        .filter(|f| !f.contains('/') && f.ends_with(".gguf"))
        .cloned()
        .collect();
    names.sort();
    names
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// The shard file names of a `model.safetensors.index.json` (the values of
/// its `weight_map`), sorted, each once.
///
/// Errors when the file cannot be read or parsed, has no `weight_map`
/// object, or names a shard that is not a plain `*.safetensors` file name.
pub fn index_shards(index: &Path) -> Result<Vec<String>> {
    let text = match std::fs::read_to_string(index) {
        Ok(t) => t,
        Err(e) => bail!("safetensors index: reading {}: {e}", index.display()),
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(j) => j,
        Err(e) => bail!("safetensors index: parsing {}: {e}", index.display()),
    };
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        bail!(
            "safetensors index: {} has no weight_map object",
            index.display()
        );
    };
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            bail!(
                "safetensors index: {}: the shard of {tensor} is {file}, not a file name",
                index.display()
            );
        };
        if !file.ends_with(".safetensors") || Path::new(file).file_name() != Some(file.as_ref()) {
            bail!(
                "safetensors index: {}: the shard of {tensor} is {file:?}, not a *.safetensors file name",
                index.display()
            );
        }
        check_relative_name("safetensors shard", file)?;
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        bail!(
            "safetensors index: {} names no shard (its weight_map is empty)",
            index.display()
        );
    }
    Ok(shards.into_iter().collect())
}

/// The files to load from `path`: a file is a GGUF checkpoint; a directory
/// with `config.json` is a safetensors checkpoint (see [`SafetensorsFiles`]
/// for the weights chosen); a directory without one that holds exactly one
/// `.gguf` file is that file.
///
/// Errors when `path` does not exist, when an index names a shard the
/// directory lacks, or when a directory holds no weights (or several GGUF
/// files and no `config.json`).
pub fn checkpoint_files(path: &Path) -> Result<CheckpointFiles> {
    if path.is_file() {
        return Ok(CheckpointFiles::Gguf(path.to_path_buf()));
    }
    if !path.is_dir() {
        bail!("checkpoint: {} does not exist", path.display());
    }
    let config = path.join("config.json");
    let listing = match std::fs::read_dir(path) {
        Ok(entries) => {
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok())
                .filter(|e| e.path().is_file())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect();
            names.sort();
            names
        }
        Err(e) => bail!("checkpoint: reading {}: {e}", path.display()),
    };
    if !config.is_file() {
        return match gguf_names(&listing).as_slice() {
            [one] => Ok(CheckpointFiles::Gguf(path.join(one))),
            [] => bail!(
                "checkpoint: {} has no config.json (a safetensors checkpoint) and no .gguf file",
                path.display()
            ),
            many => bail!(
                "checkpoint: {} has no config.json and {} GGUF files ({}): give the file",
                path.display(),
                many.len(),
                many.join(", ")
            ),
        };
    }
    let index = path.join(SAFETENSORS_INDEX);
    let weights = if index.is_file() {
        let shards = index_shards(&index)?;
        let mut weights = Vec::with_capacity(shards.len());
        for s in shards {
            let p = path.join(&s);
            if !p.is_file() {
                bail!(
                    "checkpoint: {} names the shard {s}, which {} lacks",
                    index.display(),
                    path.display()
                );
            }
            weights.push(p);
        }
        weights
    } else if path.join("model.safetensors").is_file() {
        vec![path.join("model.safetensors")]
    } else {
        listing
            .iter()
            .filter(|f| f.ends_with(".safetensors"))
            .map(|f| path.join(f))
            .collect()
    };
    if weights.is_empty() {
        bail!(
            "checkpoint: {} has config.json but no *.safetensors weights",
            path.display()
        );
    }
    let optional = |name: &str| Some(path.join(name)).filter(|p| p.is_file());
    Ok(CheckpointFiles::Safetensors(SafetensorsFiles {
        dir: path.to_path_buf(),
        config,
        tokenizer: optional("tokenizer.json"),
        tokenizer_config: optional("tokenizer_config.json"),
        weights,
    }))
}

/// The Hugging Face hub cache folder: `$HF_HUB_CACHE`, else
/// `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; `None` without any of
/// these variables and no `HOME`.
pub fn hub_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(dir) = var("HF_HUB_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(home) = var("HF_HOME") {
        return Some(PathBuf::from(home).join("hub"));
    }
    var("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub"))
}

/// The snapshot folder of `model_id` (`org/name`) at `revision` (a branch,
/// a tag or a commit hash) in the hub cache folder `cache`, laid out as the
/// hub client lays it out: `models--org--name/refs/REVISION` holds the
/// commit hash, and `models--org--name/snapshots/HASH/` the files (links
/// into `blobs/`).
///
/// Errors when the model, the revision or its snapshot is not cached.
pub fn cached_snapshot(cache: &Path, model_id: &str, revision: &str) -> Result<PathBuf> {
    if model_id.is_empty() || model_id.split('/').any(|p| p.is_empty() || p == "..") {
        bail!("hub: model id {model_id:?} is not of the form org/name");
    }
    if revision.is_empty() || revision.split('/').any(|p| p.is_empty() || p == "..") {
        bail!("hub: revision {revision:?} is not a branch, tag or commit");
    }
    let repo = cache.join(format!("models--{}", model_id.replace('/', "--")));
    if !repo.is_dir() {
        bail!(
            "hub: {model_id} is not in the cache {} (no {})",
            cache.display(),
            repo.display()
        );
    }
    let reference = repo.join("refs").join(revision);
    let (commit, source) = if reference.is_file() {
        match std::fs::read_to_string(&reference) {
            Ok(c) => (
                c.trim().to_string(),
                format!("the ref file {}", reference.display()),
            ),
            Err(e) => bail!("hub: reading {}: {e}", reference.display()),
        }
    } else {
        (revision.to_string(), "the revision".to_string())
    };
    check_commit(&source, &commit)?;
    let snapshot = repo.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        bail!(
            "hub: revision {revision} of {model_id} is not cached (no {})",
            snapshot.display()
        );
    }
    Ok(snapshot)
}

/// The files to load of `model_id` at `revision` from the hub cache folder
/// `cache` (see [`cached_snapshot`]), without the network: `gguf_file`
/// when given (it must be in the snapshot), else what [`checkpoint_files`]
/// finds in the snapshot.
pub fn cached_checkpoint(
    cache: &Path,
    model_id: &str,
    revision: &str,
    gguf_file: Option<&str>,
) -> Result<CheckpointFiles> {
    let snapshot = cached_snapshot(cache, model_id, revision)?;
    match gguf_file {
        Some(f) => {
            check_relative_name("model file", f)?;
            let path = snapshot.join(f);
            if !path.is_file() {
                bail!(
                    "hub: {f} of {model_id} at {revision} is not cached (no {})",
                    path.display()
                );
            }
            Ok(CheckpointFiles::Gguf(path))
        }
        None => checkpoint_files(&snapshot),
    }
}

/// Whether `HF_HUB_OFFLINE` asks for the hub cache only (`1`, `true`,
/// `yes` or `on`, any case).
pub fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// Downloads what [`files_to_download`] picks from the hub repository
/// `model_id` at `revision` into the hub cache (files already there are
/// reused; progress bars on stderr), and returns the files to load.
///
/// `gguf_file` names the GGUF file of a repository that holds several.
/// The client reads `HF_HOME`, `HF_ENDPOINT` and the token of
/// `huggingface-cli login`. With `HF_HUB_OFFLINE=1` ([`hub_offline`]) the
/// network is not used: the files come from [`cached_checkpoint`] in
/// [`hub_cache_dir`].
#[cfg(feature = "hub")]
pub fn download(
    model_id: &str,
    revision: &str,
    gguf_file: Option<&str>,
) -> Result<CheckpointFiles> {
    if hub_offline() {
        let Some(cache) = hub_cache_dir() else {
            bail!("hub: HF_HUB_OFFLINE is set and there is no hub cache folder (set HF_HUB_CACHE or HF_HOME)");
        };
        return cached_checkpoint(&cache, model_id, revision, gguf_file);
    }
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Repo, RepoType};

    let err = |what: &str, e: hf_hub::api::sync::ApiError| {
        candle_core::Error::Msg(format!("hub: {what} of {model_id} at {revision}: {e}"))
    };
    let mut api = ApiBuilder::from_env().with_progress(true);
    if let Some(cache) = hub_cache_dir() {
        // The folder `cached_checkpoint` reads with HF_HUB_OFFLINE.
        api = api.with_cache_dir(cache);
    }
    let api = api.build().map_err(|e| err("starting the client", e))?;
    let repo = api.repo(Repo::with_revision(
        model_id.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let info = repo.info().map_err(|e| err("listing the files", e))?;
    let listing: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let get = |f: &str| repo.get(f).map_err(|e| err(&format!("downloading {f}"), e));
    match files_to_download(&listing, gguf_file)? {
        RepoPlan::Gguf(f) => Ok(CheckpointFiles::Gguf(get(&f)?)),
        RepoPlan::Safetensors { files, index } => {
            let mut dir = None;
            for f in &files {
                dir = get(f)?.parent().map(Path::to_path_buf);
            }
            if let Some(index) = index {
                let index = get(&index)?;
                for shard in index_shards(&index)? {
                    get(&shard)?;
                }
            }
            let Some(dir) = dir else {
                bail!("hub: {model_id} at {revision}: no snapshot folder for config.json");
            };
            checkpoint_files(&dir)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error's message (its first line: no backtrace).
    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        let e = r.unwrap_err().to_string();
        e.lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn relative_names_must_stay_in_their_folder() {
        check_relative_name("model file", "m.gguf").unwrap();
        check_relative_name("model file", "Q4/m.gguf").unwrap();
        for (name, why) in [
            ("", "it is empty"),
            ("/etc/passwd", "it is an absolute path"),
            (
                "../../../etc/passwd",
                "it has an empty, `.` or `..` component",
            ),
            ("a/../../b.gguf", "it has an empty, `.` or `..` component"),
            ("a//b.gguf", "it has an empty, `.` or `..` component"),
            ("./b.gguf", "it has an empty, `.` or `..` component"),
            ("a\\..\\b.gguf", "it holds a backslash or NUL"),
            ("a\0b", "it holds a backslash or NUL"),
        ] {
            assert_eq!(
                err(check_relative_name("model file", name)),
                format!("hub: model file {name:?} would leave its folder: {why}")
            );
        }
    }

    #[test]
    fn a_listing_cannot_name_files_outside_the_repository() {
        let listing = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            err(files_to_download(
                &listing(&["../../x.gguf"]),
                Some("../../x.gguf")
            )),
            "hub: model file \"../../x.gguf\" would leave its folder: it has an empty, `.` or `..` component"
        );
        assert_eq!(
            files_to_download(&listing(&["q/m.gguf"]), Some("q/m.gguf")).unwrap(),
            RepoPlan::Gguf("q/m.gguf".into())
        );
        assert_eq!(
            err(files_to_download(
                &listing(&["/abs.gguf"]),
                Some("/abs.gguf")
            )),
            "hub: model file \"/abs.gguf\" would leave its folder: it is an absolute path"
        );
    }
}

#[cfg(all(test, unix))]
mod cache_tests {
    use super::*;

    /// The error's message (its first line: no backtrace).
    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        let e = r.unwrap_err().to_string();
        e.lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn refs_and_model_files_stay_in_the_snapshot() {
        let cache = std::env::temp_dir().join(format!("cpa-hub-refs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let repo = cache.join("models--org--m");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("snapshots").join(commit).join("m.gguf"), "g").unwrap();
        // A file outside the snapshot that `..` would reach.
        std::fs::write(repo.join("outside.gguf"), "x").unwrap();
        std::fs::write(repo.join("refs/main"), format!("{commit}\n")).unwrap();
        let snapshot = cached_snapshot(&cache, "org/m", "main").unwrap();
        assert_eq!(snapshot, repo.join("snapshots").join(commit));
        assert_eq!(
            cached_checkpoint(&cache, "org/m", "main", Some("m.gguf")).unwrap(),
            CheckpointFiles::Gguf(snapshot.join("m.gguf"))
        );
        for f in ["../../outside.gguf", "/etc/passwd", ""] {
            let e = err(cached_checkpoint(&cache, "org/m", "main", Some(f)));
            assert!(
                e.starts_with(&format!("hub: model file {f:?} would leave its folder: ")),
                "{e}"
            );
        }
        for held in ["../..", "..", "a/b", "", "..\\x"] {
            std::fs::write(repo.join("refs/main"), held).unwrap();
            assert_eq!(
                err(cached_snapshot(&cache, "org/m", "main")),
                format!(
                    "hub: the ref file {} holds {held:?}, not a commit hash (one folder name of letters, digits, -, _ and .)",
                    repo.join("refs/main").display()
                )
            );
        }
        let _ = std::fs::remove_dir_all(&cache);
    }

    #[test]
    fn index_shard_names_cannot_leave_the_snapshot() {
        let dir = std::env::temp_dir().join(format!("cpa-hub-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let index = dir.join(SAFETENSORS_INDEX);
        for (shard, want) in [
            ("../../etc/passwd", "not a *.safetensors file name"),
            ("../../x.safetensors", "not a *.safetensors file name"),
            ("/abs/x.safetensors", "not a *.safetensors file name"),
        ] {
            std::fs::write(&index, format!(r#"{{"weight_map": {{"w": "{shard}"}}}}"#)).unwrap();
            let e = err(index_shards(&index));
            assert_eq!(
                e,
                format!(
                    "safetensors index: {}: the shard of w is {shard:?}, {want}",
                    index.display()
                )
            );
        }
        std::fs::write(&index, r#"{"weight_map": {"w": "a\\..\\x.safetensors"}}"#).unwrap();
        assert_eq!(
            err(index_shards(&index)),
            "hub: safetensors shard \"a\\\\..\\\\x.safetensors\" would leave its folder: it holds a backslash or NUL"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

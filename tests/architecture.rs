//! The module layering of the crate, checked on the source text.
//!
//! * The backends (`src/cpu`, `src/cuda`) sit below `ops`: they never import
//!   it (`ops` validates and calls them), and they never import each other.
//! * `params` is a leaf below `ops` and both backends: it imports only
//!   `batch` from this crate.
//! * The serving half, in layers: `text` (tokenizers, chat templates,
//!   checkpoint files) imports none of `models`, `engine`, `server`;
//!   `models` (the paged model interface and the model zoo, whose loaders
//!   may use `text`) imports neither `engine` nor `server`; `engine` (the
//!   continuous-batching engine) imports `models`, the cache and the ops,
//!   never `text` or `server`; `server` may import all three.
//!
//! * `parallel` (tensor parallelism) sits beside `models`: its sharding
//!   plan, communicators and parallel layers are leaves that the decoder
//!   stack uses (the parallel layers call one op, the linear layers'
//!   matmul: `ops` sits below `models` and `parallel`, so no cycle), and its
//!   lockstep model imports `models`, never `engine`, `server` or `text`.
//!
//! Paths are resolved to the crate root: `crate::x`, `super::...::x` (from
//! the file's own module) and grouped `crate::{x, y}` all count.

use std::path::{Path, PathBuf};

/// The module path of a source file under `src/`, e.g. `src/cpu/elem.rs` ->
/// `["cpu", "elem"]`, `src/cpu/mod.rs` -> `["cpu"]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The source text without `//` comments (doc comments included), so that
/// prose mentioning a module is not an import.
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The top-level crate modules that `text` (a file of module `module`)
/// refers to through `crate::` or `super::` paths.
fn referenced_top_modules(module: &[String], text: &str) -> Vec<String> {
    let text = strip_comments(text);
    let bytes: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        // A path starts at an identifier boundary.
        if i > 0 && (is_ident(bytes[i - 1]) || bytes[i - 1] == ':') {
            i += 1;
            continue;
        }
        let rest: String = bytes[i..bytes.len().min(i + 256)].iter().collect();
        let (depth_up, after) = if let Some(r) = rest.strip_prefix("crate::") {
            (None, r)
        } else if rest.starts_with("super::") {
            let mut r = rest.as_str();
            let mut n = 0;
            while let Some(next) = r.strip_prefix("super::") {
                n += 1;
                r = next;
            }
            (Some(n), r)
        } else {
            i += 1;
            continue;
        };
        // Absolute prefix of the path (the modules `super` climbs to).
        let base: Vec<String> = match depth_up {
            None => Vec::new(),
            Some(n) => module[..module.len().saturating_sub(n)].to_vec(),
        };
        let names: Vec<String> = if let Some(group) = after.strip_prefix('{') {
            // `crate::{a, b::c}`: the first segment of each member.
            let end = group.find('}').unwrap_or(group.len());
            group[..end]
                .split(',')
                .map(|m| m.trim().split("::").next().unwrap_or("").to_string())
                .filter(|m| !m.is_empty())
                .collect()
        } else {
            vec![after.chars().take_while(|&c| is_ident(c)).collect()]
        };
        for name in names {
            let mut full = base.clone();
            full.push(name);
            out.push(full[0].clone());
        }
        i += 1;
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every (file, forbidden module) pair where a file under `src/{dir}`
/// refers to one of `forbidden`.
fn violations(dir: &str, forbidden: &[&str]) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let target = src.join(dir);
    if target.is_dir() {
        rust_files(&target, &mut files);
    } else {
        files.push(src.join(format!("{dir}.rs")));
    }
    assert!(!files.is_empty(), "no source files under src/{dir}");
    let mut bad = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source file");
        let module = module_path(&src, &file);
        for m in referenced_top_modules(&module, &text) {
            if forbidden.contains(&m.as_str()) {
                bad.push(format!("{} imports crate::{m}", file.display()));
            }
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

#[test]
fn checker_resolves_crate_super_and_grouped_paths() {
    let cpu = vec!["cpu".to_string(), "paged_attention".to_string()];
    let text = "use crate::ops::KvScales;\nuse super::super::cuda::x;\nuse super::elem::Elem;\n\
                use crate::{batch::BatchHost, params};\n// use crate::metadata;\nlet a = b::crate::z;";
    assert_eq!(
        referenced_top_modules(&cpu, text),
        ["ops", "cuda", "cpu", "batch", "params"]
    );
    let cpu_mod = vec!["cpu".to_string()];
    assert_eq!(
        referenced_top_modules(&cpu_mod, "use super::ops::paged_attention;"),
        ["ops"]
    );
}

#[test]
fn cpu_backend_imports_neither_ops_nor_cuda() {
    assert_eq!(violations("cpu", &["ops", "cuda"]), Vec::<String>::new());
}

#[test]
fn cuda_backend_imports_neither_ops_nor_cpu() {
    assert_eq!(violations("cuda", &["ops", "cpu"]), Vec::<String>::new());
}

#[test]
fn params_is_a_leaf_below_ops_and_the_backends() {
    let above = [
        "ops",
        "cpu",
        "cuda",
        "attention",
        "cache",
        "metadata",
        "models",
        "reference",
        "remap",
    ];
    assert_eq!(violations("params", &above), Vec::<String>::new());
}

#[test]
fn checkpoint_limits_are_a_leaf() {
    // `models::limits` checks what a checkpoint declares before any loader
    // acts on it: it imports nothing else of the crate. Paths inside it
    // resolve to `models` here, so the rest of `models` is checked on the
    // text: no `super::super`, no `crate::models`.
    let others = [
        "attention",
        "batch",
        "cache",
        "cpu",
        "cuda",
        "metadata",
        "ops",
        "params",
        "reference",
        "remap",
    ];
    assert_eq!(violations("models/limits", &others), Vec::<String>::new());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/models/limits");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(!files.is_empty());
    for f in files {
        let text = strip_comments(&std::fs::read_to_string(&f).expect("readable source file"));
        assert!(
            !text.contains("super::super") && !text.contains("crate::models"),
            "{} imports the rest of models",
            f.display()
        );
    }
}

#[test]
fn only_the_module_root_and_the_examples_sit_above_the_registry() {
    // The registry maps architectures to the models' loaders: the models sit
    // below it and never name it (the module root re-exports `load`).
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/models");
    let mut files = Vec::new();
    rust_files(&models, &mut files);
    let mut bad: Vec<String> = files
        .iter()
        .filter(|f| !f.ends_with("registry.rs") && !f.ends_with("models/mod.rs"))
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("readable source file");
            strip_comments(&text).contains("registry::")
        })
        .map(|f| f.display().to_string())
        .collect();
    bad.sort();
    assert_eq!(bad, Vec::<String>::new());
}

/// Every top-level module of the crate but `parallel`.
const NOT_PARALLEL: [&str; 14] = [
    "attention",
    "batch",
    "cache",
    "cpu",
    "cuda",
    "engine",
    "metadata",
    "models",
    "ops",
    "params",
    "reference",
    "remap",
    "server",
    "text",
];

#[test]
fn the_sharding_plan_communicators_and_parallel_layers_are_leaves() {
    // The decoder stack imports them, so they import nothing of the crate
    // outside `parallel` (no cycle through `models`); the parallel layers
    // may call the ops (the linear layers' matmul), which import neither
    // `models` nor `parallel`.
    for leaf in ["parallel/shard", "parallel/comm"] {
        assert_eq!(violations(leaf, &NOT_PARALLEL), Vec::<String>::new());
    }
    let below_ops: Vec<&str> = NOT_PARALLEL.into_iter().filter(|&m| m != "ops").collect();
    assert_eq!(
        violations("parallel/layers", &below_ops),
        Vec::<String>::new()
    );
    assert_eq!(
        violations("ops", &["models", "parallel", "engine", "server", "text"]),
        Vec::<String>::new()
    );
    // The checker sees what the leaves import from each other.
    let module = vec!["parallel".to_string(), "layers".to_string()];
    assert_eq!(
        referenced_top_modules(&module, "use super::comm::Communicator;"),
        ["parallel"]
    );
}

#[test]
fn tensor_parallelism_imports_neither_the_engine_the_server_nor_text() {
    assert_eq!(
        violations("parallel", &["engine", "server", "text"]),
        Vec::<String>::new()
    );
    // The rule scans files that import the models (the lockstep model).
    assert!(!violations("parallel", &["models"]).is_empty());
}

/// The top-level modules the serving half may not import, by module.
const SERVING_LAYERS: [(&str, &[&str]); 3] = [
    ("text", &["models", "engine", "server"]),
    ("models", &["engine", "server"]),
    ("engine", &["text", "server"]),
];

/// What the serving layer `dir` may not import.
fn serving_rule(dir: &str) -> &'static [&'static str] {
    SERVING_LAYERS
        .iter()
        .find(|(d, _)| *d == dir)
        .map(|(_, forbidden)| *forbidden)
        .expect("a serving layer")
}

#[test]
fn text_imports_no_model_engine_or_server() {
    assert_eq!(
        violations("text", serving_rule("text")),
        Vec::<String>::new()
    );
}

#[test]
fn models_import_neither_the_engine_nor_the_server() {
    assert_eq!(
        violations("models", serving_rule("models")),
        Vec::<String>::new()
    );
}

#[test]
fn the_engine_imports_neither_text_nor_the_server() {
    assert_eq!(
        violations("engine", serving_rule("engine")),
        Vec::<String>::new()
    );
}

#[test]
fn the_serving_rules_see_the_imports_they_allow() {
    // Each rule scans its module's files: the imports that are allowed are
    // found there, so a forbidden one would be too.
    for (dir, allowed) in [
        ("engine", "models"),
        ("engine", "cache"),
        ("models", "text"),
        ("server", "engine"),
        ("server", "text"),
    ] {
        assert!(
            !violations(dir, &[allowed]).is_empty(),
            "src/{dir} is expected to import crate::{allowed}"
        );
    }
    // And the checker catches a forbidden import in each of their forms.
    for (dir, forbidden) in SERVING_LAYERS {
        let module = vec![dir.to_string(), "x".to_string()];
        for f in forbidden {
            for text in [
                format!("use crate::{f}::Y;"),
                format!("use super::super::{f}::Y;"),
                format!("use crate::{{cache, {f}::Y}};"),
            ] {
                assert!(
                    referenced_top_modules(&module, &text).contains(&f.to_string()),
                    "{text}"
                );
            }
        }
    }
}

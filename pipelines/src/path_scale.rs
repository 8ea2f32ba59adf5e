//! `FILE` or `FILE:SCALE`, as the `--lora` and `--controlnet` flags take them.

use std::path::PathBuf;

/// Splits `text` into a path and a scale (1 when absent); a tail after the last `:` that is
/// not a number stays part of the path (so `C:\loras\x.safetensors` works). `what` names the
/// scale in errors ("LoRA", "ControlNet").
pub fn parse_path_scale(text: &str, what: &str) -> Result<(PathBuf, f32), String> {
    if text.is_empty() {
        return Err("expected FILE or FILE:SCALE".into());
    }
    if let Some((path, scale)) = text.rsplit_once(':') {
        if let Ok(scale) = scale.trim().parse::<f32>() {
            if !scale.is_finite() {
                return Err(format!("{what} scale `{scale}` is not a finite number"));
            }
            if path.is_empty() {
                return Err("expected FILE:SCALE, found no file".into());
            }
            return Ok((PathBuf::from(path), scale));
        }
    }
    Ok((PathBuf::from(text), 1.0))
}

//! Generation parameters in a PNG's `parameters` text chunk, in the format AUTOMATIC1111's web
//! UI writes and other tools (ComfyUI importers, civitai, image viewers) read:
//!
//! ```text
//! a photo of an astronaut riding a horse
//! Negative prompt: blurry
//! Steps: 20, Sampler: DPM++ 2M Karras, CFG scale: 7.5, Seed: 42, Size: 512x512, Model: sd15
//! ```
//!
//! The prompt may span several lines; the last line holds `Key: value` pairs, a value quoted as
//! a JSON string when it contains a comma, colon or quote. PNG text is untrusted input: reading
//! never panics, and a file without the chunk or with a malformed one is a clear error.

use std::io::Cursor;
use std::path::Path;

use oxidiff_schedulers::SchedulerKind;

use crate::error::{PipelineError, Result};

/// The PNG text keyword A1111 uses.
pub const PARAMETERS_KEYWORD: &str = "parameters";

/// The line start that separates the prompt from the negative prompt.
const NEGATIVE_PROMPT: &str = "Negative prompt:";

/// The most bytes a compressed (zTXt or iTXt) text chunk may inflate to: generation parameters
/// are a few kilobytes, and a small chunk could otherwise inflate to gigabytes.
pub const MAX_TEXT_BYTES: usize = 1 << 20;

/// What made an image, enough to make it again.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationParameters {
    pub prompt: String,
    pub negative_prompt: String,
    pub steps: usize,
    /// The sampler as the user named it (`Euler a`, `DPM++ 2M Karras`, a diffusers class).
    pub sampler: String,
    pub guidance_scale: f64,
    pub seed: u64,
    pub width: usize,
    pub height: usize,
    /// The model as given to oxidiff (a folder or Hub id).
    pub model: String,
    /// A1111's `Model hash` ([`crate::model_hash`]); empty when not known.
    pub model_hash: String,
    /// Any other `Key: value` pairs, in order (oxidiff's own, or another tool's).
    pub extra: Vec<(String, String)>,
}

impl GenerationParameters {
    /// The A1111-style text.
    pub fn to_text(&self) -> String {
        let mut text = escape_lines(&self.prompt);
        if !self.negative_prompt.is_empty() {
            text.push('\n');
            text.push_str(NEGATIVE_PROMPT);
            text.push(' ');
            text.push_str(&escape_lines(&self.negative_prompt));
        }
        let mut pairs = vec![
            ("Steps".to_string(), self.steps.to_string()),
            ("Sampler".to_string(), self.sampler.clone()),
            ("CFG scale".to_string(), format_number(self.guidance_scale)),
            ("Seed".to_string(), self.seed.to_string()),
            (
                "Size".to_string(),
                format!("{}x{}", self.width, self.height),
            ),
        ];
        if !self.model_hash.is_empty() {
            pairs.push(("Model hash".to_string(), self.model_hash.clone()));
        }
        pairs.push(("Model".to_string(), self.model.clone()));
        pairs.extend(self.extra.iter().cloned());
        let line = pairs
            .iter()
            .map(|(k, v)| format!("{k}: {}", quote(v)))
            .collect::<Vec<_>>()
            .join(", ");
        text.push('\n');
        text.push_str(&line);
        text
    }

    /// Parses A1111-style text. Fields other tools add are kept in `extra`; `Steps`, `Seed`
    /// and `Size` must be present and well formed, the others default as A1111 does
    /// (`CFG scale` 7, `Sampler` "Euler a").
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |what: String| {
            PipelineError::InvalidInput(format!("PNG generation parameters: {what}"))
        };
        let text = text.trim_end();
        let (body, last) = match text.rsplit_once('\n') {
            Some((body, last)) => (body, last),
            None => ("", text),
        };
        let pairs = parse_pairs(last).ok_or_else(|| {
            bad("the last line is not a list of `Key: value` pairs (no `Steps:` line)".into())
        })?;
        // The first line that starts with the marker itself (not an escaped one) begins the
        // negative prompt.
        let marker = body
            .match_indices(NEGATIVE_PROMPT)
            .map(|(at, _)| at)
            .find(|&at| at == 0 || body[..at].ends_with('\n'));
        let (prompt, negative) = match marker {
            Some(at) => (
                unescape_lines(body[..at].trim_end_matches('\n')),
                unescape_lines(body[at + NEGATIVE_PROMPT.len()..].trim()),
            ),
            None => (unescape_lines(body), String::new()),
        };
        let mut params = GenerationParameters {
            prompt,
            negative_prompt: negative,
            steps: 0,
            sampler: "Euler a".into(),
            guidance_scale: 7.0,
            seed: 0,
            width: 0,
            height: 0,
            model: String::new(),
            model_hash: String::new(),
            extra: Vec::new(),
        };
        let (mut steps, mut seed, mut size) = (false, false, false);
        for (key, value) in pairs {
            let number = |what: &str| bad(format!("`{key}: {value}` is not {what}"));
            match key.as_str() {
                "Steps" => {
                    params.steps = value.parse().map_err(|_| number("a step count"))?;
                    steps = true;
                }
                "Seed" => {
                    params.seed = value.parse().map_err(|_| number("a seed"))?;
                    seed = true;
                }
                "Size" => {
                    let (w, h) = value
                        .split_once('x')
                        .ok_or_else(|| number("WIDTHxHEIGHT"))?;
                    params.width = w.trim().parse().map_err(|_| number("WIDTHxHEIGHT"))?;
                    params.height = h.trim().parse().map_err(|_| number("WIDTHxHEIGHT"))?;
                    size = true;
                }
                "CFG scale" => {
                    params.guidance_scale = value
                        .parse()
                        .ok()
                        .filter(|g: &f64| g.is_finite())
                        .ok_or_else(|| number("a number"))?;
                }
                "Sampler" => params.sampler = value,
                "Model" => params.model = value,
                "Model hash" => params.model_hash = value,
                _ => params.extra.push((key, value)),
            }
        }
        for (present, key) in [(steps, "Steps"), (seed, "Seed"), (size, "Size")] {
            if !present {
                return Err(bad(format!("no `{key}:` field")));
            }
        }
        Ok(params)
    }

    /// Reads the `parameters` text of a PNG file.
    pub fn from_png(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| {
            PipelineError::InvalidInput(format!("cannot read {}: {e}", path.display()))
        })?;
        Self::from_png_bytes(&bytes, path)
    }

    /// Reads the `parameters` text of PNG `bytes` read from `path` (named in errors), for
    /// callers that read the file themselves (with a size limit, say).
    pub fn from_png_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let text = png_text(bytes, PARAMETERS_KEYWORD)
            .map_err(|e| PipelineError::InvalidInput(format!("{}: {e}", path.display())))?
            .ok_or_else(|| {
                PipelineError::InvalidInput(format!(
                    "{} has no `{PARAMETERS_KEYWORD}` text chunk: it was not written by \
                     oxidiff or another tool that records generation parameters",
                    path.display()
                ))
            })?;
        Self::parse(&text).map_err(|e| match e {
            PipelineError::InvalidInput(m) => {
                PipelineError::InvalidInput(format!("{}: {m}", path.display()))
            }
            other => other,
        })
    }
}

/// Encodes an 8-bit RGB image as PNG with `text` entries (`tEXt` when Latin-1, else `iTXt`, as
/// PIL does).
pub fn encode_png(image: &image::RgbImage, text: &[(&str, String)]) -> Result<Vec<u8>> {
    let err = |e: String| PipelineError::InvalidInput(format!("encoding PNG: {e}"));
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(Cursor::new(&mut out), image.width(), image.height());
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        for (keyword, value) in text {
            let latin1 = value.chars().all(|c| (c as u32) < 256 && c != '\0');
            let added = if latin1 {
                encoder.add_text_chunk(keyword.to_string(), value.clone())
            } else {
                encoder.add_itxt_chunk(keyword.to_string(), value.clone())
            };
            added.map_err(|e| err(e.to_string()))?;
        }
        let mut writer = encoder.write_header().map_err(|e| err(e.to_string()))?;
        writer
            .write_image_data(image.as_raw())
            .map_err(|e| err(e.to_string()))?;
        writer.finish().map_err(|e| err(e.to_string()))?;
    }
    Ok(out)
}

/// The text stored under `keyword` in PNG `bytes` (tEXt, zTXt or iTXt), if any.
pub fn png_text(bytes: &[u8], keyword: &str) -> std::result::Result<Option<String>, String> {
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    // Text chunks are read with the header; cap what a hostile file can make us hold.
    decoder.set_limits(png::Limits { bytes: 64 << 20 });
    let reader = decoder
        .read_info()
        .map_err(|e| format!("not a readable PNG file ({e})"))?;
    let info = reader.info();
    if let Some(t) = info
        .uncompressed_latin1_text
        .iter()
        .find(|t| t.keyword == keyword)
    {
        return Ok(Some(t.text.clone()));
    }
    if let Some(t) = info
        .compressed_latin1_text
        .iter()
        .find(|t| t.keyword == keyword)
    {
        let mut t = t.clone();
        return t
            .decompress_text_with_limit(MAX_TEXT_BYTES)
            .and_then(|()| t.get_text())
            .map(Some)
            .map_err(|e| inflate_error(keyword, e));
    }
    if let Some(t) = info.utf8_text.iter().find(|t| t.keyword == keyword) {
        let mut t = t.clone();
        return t
            .decompress_text_with_limit(MAX_TEXT_BYTES)
            .and_then(|()| t.get_text())
            .map(Some)
            .map_err(|e| inflate_error(keyword, e));
    }
    Ok(None)
}

/// A1111's sampler name for `kind`, where diffusers' A1111/k-diffusion table has one (DEIS,
/// UniPC, LCM and the rest have none there).
pub fn a1111_sampler_name(kind: SchedulerKind) -> Option<&'static str> {
    Some(match kind {
        SchedulerKind::DpmSolverMultistep => "DPM++ 2M",
        SchedulerKind::DpmSolverSinglestep => "DPM++ SDE",
        SchedulerKind::KDpm2Discrete => "DPM2",
        SchedulerKind::KDpm2AncestralDiscrete => "DPM2 a",
        SchedulerKind::EulerDiscrete => "Euler",
        SchedulerKind::EulerAncestralDiscrete => "Euler a",
        SchedulerKind::HeunDiscrete => "Heun",
        SchedulerKind::LmsDiscrete => "LMS",
        _ => return None,
    })
}

/// The `Sampler:` a PNG records: the A1111 name of the scheduler that ran when there is one,
/// else its diffusers class. A name the user gave with A1111's option words
/// ("DPM++ 2M Karras") is kept as given; `kind` is the scheduler that ran.
pub fn sampler_field(given: Option<&str>, kind: SchedulerKind) -> String {
    match given {
        Some(name) if name.parse::<SchedulerKind>().is_err() => name.to_string(),
        _ => a1111_sampler_name(kind)
            .unwrap_or(kind.class_name())
            .to_string(),
    }
}

/// A text chunk that would not inflate: too large, or damaged.
fn inflate_error(keyword: &str, e: png::DecodingError) -> String {
    // png reports the limit only through its message ("Out of decompression space").
    if e.to_string().contains("decompression space") {
        format!(
            "the compressed text chunk `{keyword}` inflates to more than {MAX_TEXT_BYTES} bytes"
        )
    } else {
        format!("damaged compressed text chunk `{keyword}` ({e})")
    }
}

/// A prompt with each line that starts with the negative-prompt marker or a backslash given
/// one more backslash, so that the text parses back into the same prompt.
fn escape_lines(prompt: &str) -> String {
    prompt
        .split('\n')
        .map(|line| {
            if line.starts_with(NEGATIVE_PROMPT) || line.starts_with('\\') {
                format!("\\{line}")
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Undoes [`escape_lines`]: a backslash that starts a line is dropped.
fn unescape_lines(text: &str) -> String {
    text.split('\n')
        .map(|line| line.strip_prefix('\\').unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `Key: value` pairs of a parameters line, A1111's way: values are bare up to the next comma,
/// or JSON strings. `None` when the line does not look like one (no `Steps` key).
fn parse_pairs(line: &str) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut rest = line.trim();
    while !rest.is_empty() {
        let colon = rest.find(':')?;
        let key = rest[..colon].trim();
        let key_ok = key
            .chars()
            .next()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
            && key
                .chars()
                .all(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '/' | '_'));
        if !key_ok {
            return None;
        }
        rest = rest[colon + 1..].trim_start();
        let value;
        if rest.starts_with('"') {
            let end = closing_quote(rest)?;
            value = serde_json::from_str::<String>(&rest[..=end]).ok()?;
            rest = rest[end + 1..].trim_start();
            rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            value = rest[..end].trim().to_string();
            rest = rest[end..].strip_prefix(',').unwrap_or("").trim_start();
        }
        pairs.push((key.to_string(), value));
    }
    pairs.iter().any(|(k, _)| k == "Steps").then_some(pairs)
}

/// Index of the quote closing the JSON string that starts `s`.
fn closing_quote(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

/// A value as A1111 writes it: bare, or a JSON string when it holds `,`, `:` or `"` (or a
/// newline, which would break the one-line format).
fn quote(value: &str) -> String {
    if value.contains([',', ':', '"', '\n']) {
        serde_json::to_string(value).unwrap_or_else(|_| value.to_string())
    } else {
        value.to_string()
    }
}

/// 7.5 as `7.5`, 7 as `7.0` (what A1111 writes for a float).
fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        v.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> GenerationParameters {
        GenerationParameters {
            prompt: "a photo of an astronaut, riding a horse\nsecond line: more".into(),
            negative_prompt: "blurry, lowres".into(),
            steps: 20,
            sampler: "DPM++ 2M Karras".into(),
            guidance_scale: 7.5,
            seed: 42,
            width: 512,
            height: 768,
            model: "runwayml/stable-diffusion-v1-5".into(),
            model_hash: "6ce0161689".into(),
            extra: vec![("Version".into(), "oxidiff 0.1.0".into())],
        }
    }

    #[test]
    fn round_trips_through_text() {
        let p = sample();
        let text = p.to_text();
        assert_eq!(
            text.lines().last().unwrap(),
            "Steps: 20, Sampler: DPM++ 2M Karras, CFG scale: 7.5, Seed: 42, Size: 512x768, \
             Model hash: 6ce0161689, Model: runwayml/stable-diffusion-v1-5, Version: oxidiff 0.1.0"
        );
        assert_eq!(GenerationParameters::parse(&text).unwrap(), p);
    }

    #[test]
    fn a_negative_prompt_marker_inside_a_prompt_round_trips() {
        let mut p = sample();
        p.prompt = "a cat\nNegative prompt: not this one\n\\backslash".into();
        p.negative_prompt = "dogs\nNegative prompt: twice".into();
        assert_eq!(GenerationParameters::parse(&p.to_text()).unwrap(), p);
        p.negative_prompt.clear();
        assert_eq!(GenerationParameters::parse(&p.to_text()).unwrap(), p);
    }

    #[test]
    fn compressed_text_inflating_past_the_limit_is_refused() {
        let image = image::RgbImage::from_pixel(2, 2, image::Rgb([0, 0, 0]));
        let mut out = Vec::new();
        {
            let mut encoder = png::Encoder::new(Cursor::new(&mut out), 2, 2);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let huge = "a".repeat(MAX_TEXT_BYTES + 1);
            encoder
                .add_ztxt_chunk(PARAMETERS_KEYWORD.to_string(), huge)
                .unwrap();
            let mut writer = encoder.write_header().unwrap();
            writer.write_image_data(image.as_raw()).unwrap();
            writer.finish().unwrap();
        }
        let err = png_text(&out, PARAMETERS_KEYWORD).unwrap_err();
        assert!(err.contains("inflates to more than"), "{err}");
    }

    #[test]
    fn samplers_are_recorded_by_their_a1111_names() {
        let euler_a = SchedulerKind::EulerAncestralDiscrete;
        assert_eq!(sampler_field(None, euler_a), "Euler a");
        assert_eq!(sampler_field(Some("euler_a"), euler_a), "Euler a");
        let dpm = SchedulerKind::DpmSolverMultistep;
        assert_eq!(
            sampler_field(Some("DPM++ 2M Karras"), dpm),
            "DPM++ 2M Karras"
        );
        let unipc = SchedulerKind::UniPcMultistep;
        assert_eq!(sampler_field(None, unipc), "UniPCMultistepScheduler");
    }

    #[test]
    fn reads_what_a1111_writes() {
        let text = "masterpiece, 1girl\nNegative prompt: bad hands\nSteps: 28, Sampler: Euler a, \
                    CFG scale: 7, Seed: 3456789012, Size: 512x512, Model hash: 6ce0161689, \
                    Model: v1-5-pruned-emaonly, Lora hashes: \"add_detail: 7c6bad76eb54\", \
                    Version: v1.6.0";
        let p = GenerationParameters::parse(text).unwrap();
        assert_eq!(p.prompt, "masterpiece, 1girl");
        assert_eq!(p.negative_prompt, "bad hands");
        assert_eq!(
            (p.steps, p.seed, p.width, p.height),
            (28, 3456789012, 512, 512)
        );
        assert_eq!(p.sampler, "Euler a");
        assert_eq!(p.guidance_scale, 7.0);
        assert_eq!(p.model, "v1-5-pruned-emaonly");
        assert_eq!(p.model_hash, "6ce0161689");
        assert_eq!(
            p.extra,
            vec![
                (
                    "Lora hashes".to_string(),
                    "add_detail: 7c6bad76eb54".to_string()
                ),
                ("Version".to_string(), "v1.6.0".to_string()),
            ]
        );
    }

    #[test]
    fn malformed_text_is_an_error() {
        for text in [
            "",
            "just a prompt",
            "prompt\nSteps: twenty, Seed: 1, Size: 8x8",
            "prompt\nSteps: 4, Size: 8x8",
            "prompt\nSteps: 4, Seed: 1, Size: 8",
            "prompt\nSteps: 4, Seed: 1, Size: 8x8, CFG scale: NaN",
            "prompt\nSteps: 4, Seed: \"1",
        ] {
            let err = GenerationParameters::parse(text).unwrap_err().to_string();
            assert!(err.contains("PNG generation parameters"), "{text:?}: {err}");
        }
    }

    #[test]
    fn arbitrary_text_never_panics() {
        // A small xorshift over bytes that matter to the parser.
        let alphabet = b"ab \n:,\"\\x0123456789Steps:Seed:Size:Negative prompt:";
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let len = (state % 48) as usize;
            let text: String = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    alphabet[(state % alphabet.len() as u64) as usize] as char
                })
                .collect();
            let _ = GenerationParameters::parse(&text);
            state = state.wrapping_add(1);
        }
    }

    #[test]
    fn png_round_trip_latin1_and_unicode() {
        let image = image::RgbImage::from_pixel(4, 2, image::Rgb([10, 20, 30]));
        for prompt in ["plain ascii", "un château, 城堡"] {
            let mut p = sample();
            p.prompt = prompt.into();
            let bytes = encode_png(&image, &[(PARAMETERS_KEYWORD, p.to_text())]).unwrap();
            let text = png_text(&bytes, PARAMETERS_KEYWORD).unwrap().unwrap();
            assert_eq!(GenerationParameters::parse(&text).unwrap(), p);
            let decoded = image::load_from_memory(&bytes).unwrap().to_rgb8();
            assert_eq!(decoded, image);
        }
        assert!(png_text(b"not a png", PARAMETERS_KEYWORD).is_err());
    }
}

//! A PNG from a stranger (`txt2img --from-png`): its text chunks and the A1111-style
//! parameters in them give values or errors, never panics; what parses, prints and parses back
//! the same.

use oxidiff_pipelines::metadata::{png_text, PARAMETERS_KEYWORD};
use oxidiff_pipelines::GenerationParameters;

/// One input: returns normally or panics (a finding).
pub fn run(data: &[u8]) {
    if let Ok(Some(text)) = png_text(data, PARAMETERS_KEYWORD) {
        let _ = GenerationParameters::parse(&text);
    }
    let text = String::from_utf8_lossy(data);
    if let Ok(p) = GenerationParameters::parse(&text) {
        let again = GenerationParameters::parse(&p.to_text());
        assert!(
            again.is_ok(),
            "printed parameters do not parse back: {:?}",
            p.to_text()
        );
    }
}

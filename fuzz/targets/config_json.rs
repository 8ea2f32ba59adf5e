//! `config.json` / `scheduler_config.json` from a stranger: parsing, validation, and the
//! scheduler's host math (timesteps, sigmas) give values or errors, never panics.

use std::path::Path;

use burn_flex::Flex;
use oxidiff_models::autoencoder_kl::AutoencoderKLConfig;
use oxidiff_models::config::parse_json;
use oxidiff_models::unet_2d_condition::UNet2DConditionConfig;
use oxidiff_schedulers::{scheduler_from_config, SchedulerConfig};

/// One input: returns normally or panics (a finding).
pub fn run(data: &[u8]) {
    let Some((&steps, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let path = Path::new("fuzz/config.json");
    if let Ok(c) = parse_json::<UNet2DConditionConfig>(text, path) {
        let _ = c.validate(path);
    }
    if let Ok(c) = parse_json::<AutoencoderKLConfig>(text, path) {
        if c.validate(path).is_ok() {
            std::hint::black_box(c.scale_factor());
        }
    }
    if let Ok(c) = SchedulerConfig::from_json_str(text, "fuzz") {
        if let Ok(mut s) = scheduler_from_config::<Flex>(&c) {
            let _ = s.set_timesteps(usize::from(steps % 64));
            std::hint::black_box(s.timesteps().len());
            std::hint::black_box(s.init_noise_sigma());
        }
    }
}

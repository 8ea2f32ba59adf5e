//! Device faults and long runs on XLA's CPU plugin (eager PJRT): a failure injected into the
//! PJRT layer in the middle of a generation ends it with a clear error, frees the run's device
//! buffers, and leaves images written earlier intact; many generations in a row keep device
//! buffers and process memory flat once the caches are warm.

mod common;

use common::{files_in, model_dir};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, StableDiffusionPipeline};
use oxidiff::{Oxi, OxiDevice, ToDevice};

fn device() -> OxiDevice {
    "xla:cpu"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"))
}

fn client(device: &OxiDevice) -> oxidiff::backend::eager::PjrtClient {
    oxidiff::backend::pjrt_client(device).expect("a PJRT device")
}

fn request(seed: u64) -> GenerateRequest<Oxi> {
    GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        num_inference_steps: 2,
        guidance_scale: 7.5,
        seed,
        ..Default::default()
    }
}

/// Resident set size of this process, in bytes.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[test]
fn device_fault_mid_run_and_a_long_run_on_xla_cpu() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let device = device();
    let pipe = StableDiffusionPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &OxiDevice::Cpu,
    )
    .unwrap();
    let mut pipe = pipe.to(&device);
    let client = client(&device);
    let out = tempfile::tempdir().unwrap();

    // The first image warms the op caches; it is written to disk.
    let first = pipe.generate(&request(7)).unwrap();
    let first_png = out.path().join("0.png");
    first.images.unwrap().save_png(0, &first_png).unwrap();
    drop(first.latents);
    let first_bytes = std::fs::read(&first_png).unwrap();
    let baseline = client.stats().buffers;

    // Many images in a row: device buffers back to the baseline after each, process memory flat.
    let mut rss = Vec::new();
    for i in 1..=6 {
        let image = pipe.generate(&request(7 + i)).unwrap();
        image
            .images
            .unwrap()
            .save_png(0, &out.path().join(format!("{i}.png")))
            .unwrap();
        drop(image.latents);
        assert_eq!(
            client.stats().buffers,
            baseline,
            "image {i}: leaked buffers"
        );
        rss.push(rss_bytes());
    }
    let growth = rss.last().unwrap().saturating_sub(rss[1]);
    eprintln!(
        "device buffers {baseline} after every image; rss per image (MB): {:?}",
        rss.iter().map(|b| b / (1 << 20)).collect::<Vec<_>>()
    );
    assert!(
        growth < 64 << 20,
        "memory grew by {} MB over 5 warm images",
        growth >> 20
    );

    // A fault 40 ops into the next run: a clear error, no image, buffers freed, files intact.
    client.inject_fault(
        40,
        "RESOURCE_EXHAUSTED: out of device memory (injected by the test)",
    );
    let err = pipe.generate(&request(99)).unwrap_err().to_string();
    assert!(err.contains("the device failed"), "{err}");
    assert!(
        err.contains("RESOURCE_EXHAUSTED: out of device memory"),
        "{err}"
    );
    // At most the baseline: the scheduler's state from the previous run (PNDM keeps its last
    // model outputs until the next `set_timesteps`) was reset and not rebuilt.
    let after_fault = client.stats().buffers;
    assert!(
        after_fault <= baseline,
        "the failed run leaked buffers: {after_fault} > {baseline}"
    );
    assert_eq!(std::fs::read(&first_png).unwrap(), first_bytes);
    assert_eq!(
        files_in(out.path()),
        ["0.png", "1.png", "2.png", "3.png", "4.png", "5.png", "6.png"]
    );

    // The device is usable again, and gives the same image for the same seed.
    let again = pipe.generate(&request(7)).unwrap();
    let again_png = out.path().join("again.png");
    again.images.unwrap().save_png(0, &again_png).unwrap();
    assert_eq!(std::fs::read(&again_png).unwrap(), first_bytes);
    drop(again.latents);
    assert_eq!(client.stats().buffers, baseline);
}

//! The compiled denoising step of the tiny SD pipeline (UNet and classifier-free guidance, as
//! `pipe.compile()` runs it) compiled ahead of time for TPU v5e and v6e with libtpu, on a
//! machine without a TPU (`tools/fetch-plugins.sh --only tpu`), with XLA's cost analysis read
//! back. Its own test binary, so libtpu stays out of the XLA CPU plugin's processes.

mod common;

use oxidiff::backend::pjrt::{CompileOptions, Error, Plugin};
use oxidiff::pipelines::aot::trace_guided_step;

fn libtpu() -> Option<Plugin> {
    match Plugin::discover("tpu") {
        Ok(plugin) => Some(plugin),
        Err(e @ Error::PluginNotFound { .. })
            if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") =>
        {
            eprintln!("skipped (OXIDIFF_SKIP_PJRT_TESTS=1): {e}");
            None
        }
        Err(e) => panic!("{e}\n(set OXIDIFF_SKIP_PJRT_TESTS=1 to skip PJRT tests instead)"),
    }
}

#[test]
fn tiny_compiled_unet_step_compiles_ahead_of_time_for_tpu_v5e_and_v6e() {
    let Some(plugin) = libtpu() else {
        return;
    };
    let unet = common::model_dir("tiny-sd1").join("unet");
    // 64x64 images: 8x8 latents, the fixture's sample size.
    let guided = trace_guided_step(&unet, None, 1, 8, 8, true).unwrap_or_else(|e| panic!("{e}"));
    let plain = trace_guided_step(&unet, None, 1, 8, 8, false).unwrap_or_else(|e| panic!("{e}"));
    // The weights are arguments of the program (device buffers at run time), not constants.
    assert!(guided.weights > 50, "{} weight arguments", guided.weights);
    eprintln!(
        "traced step: {} ops, {} KiB of StableHLO, {} weight arguments ({} KiB)",
        guided.ops,
        guided.module.len() / 1024,
        guided.weights,
        guided.weight_bytes / 1024
    );

    for topology_name in ["v5e:2x2x1", "v6e:2x2x1"] {
        let topology = plugin
            .topology(topology_name, &[])
            .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
        // The unguided step once (each compile takes tens of seconds here).
        let steps: &[&_] = if topology_name.starts_with("v5e") {
            &[&guided, &plain]
        } else {
            &[&guided]
        };
        let mut flops = Vec::new();
        for step in steps {
            let started = std::time::Instant::now();
            let exe = topology
                .compile(&step.module, &CompileOptions::default())
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let compile = started.elapsed();
            assert_eq!(exe.num_outputs().ok(), Some(1));
            let code = exe
                .generated_code_size()
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let cost = exe
                .cost_analysis()
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let serialized = exe.serialize().unwrap_or_else(|e| panic!("{e}")).len();
            let f = cost.flops().expect("XLA reports flops");
            let bytes = cost.bytes_accessed().expect("XLA reports bytes accessed");
            eprintln!(
                "{topology_name} guidance={}: compiled in {compile:.2?}, {code} bytes of code, {serialized} serialized; {f:.4e} flops, {bytes:.4e} bytes accessed; all properties: {:?}",
                step.guidance, cost.properties
            );
            assert!(code > 0, "generated code size {code}");
            assert!(f > 0.0 && bytes > 0.0);
            // Every weight is read at least once.
            assert!(
                bytes >= step.weight_bytes as f64,
                "{bytes} bytes accessed, fewer than the {} bytes of weights",
                step.weight_bytes
            );
            flops.push(f);
        }
        // Guidance runs the UNet on twice the batch: about twice the flops.
        if let [guided, plain] = flops[..] {
            let ratio = guided / plain;
            assert!(
                (1.8..=2.2).contains(&ratio),
                "{topology_name}: guided/plain flops {ratio}"
            );
        }
    }
}

//! Shared by the plugin tests: finding the plugin under test, and the
//! `OXIDIFF_SKIP_PJRT_TESTS` escape hatch.

#![allow(dead_code)]

use oxidiff_backend_tpu::pjrt::{Error, Plugin};

/// Whether missing plugins may skip tests instead of failing them.
pub fn skip_allowed() -> bool {
    std::env::var("OXIDIFF_SKIP_PJRT_TESTS").is_ok_and(|v| v == "1")
}

/// The plugin for `name`. A missing plugin fails the test with the message
/// saying how to fetch it, unless `OXIDIFF_SKIP_PJRT_TESTS=1` (then `None`).
pub fn plugin(name: &str) -> Option<Plugin> {
    match Plugin::discover(name) {
        Ok(plugin) => Some(plugin),
        Err(e @ Error::PluginNotFound { .. }) if skip_allowed() => {
            eprintln!("skipped (OXIDIFF_SKIP_PJRT_TESTS=1): {e}");
            None
        }
        Err(e) => panic!("{e}\n(set OXIDIFF_SKIP_PJRT_TESTS=1 to skip PJRT tests instead)"),
    }
}

/// `main(a, b) = a + b` on 2x3 tensors of `ty`.
pub fn add_module(ty: &str) -> String {
    format!(
        r#"module @add attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{
  func.func public @main(%a: tensor<2x3x{ty}>, %b: tensor<2x3x{ty}>) -> tensor<2x3x{ty}> {{
    %0 = stablehlo.add %a, %b : tensor<2x3x{ty}>
    return %0 : tensor<2x3x{ty}>
  }}
}}
"#
    )
}

/// `main(a, b) = a @ b` for bf16 4x8 and 8x16, accumulating in f32.
pub const DOT_MODULE: &str = r#"module @dot {
  func.func public @main(%a: tensor<4x8xbf16>, %b: tensor<8x16xbf16>) -> tensor<4x16xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x8xbf16>, tensor<8x16xbf16>) -> tensor<4x16xf32>
    return %0 : tensor<4x16xf32>
  }
}
"#;

/// A 3x3 same-padded NHWC convolution, 4 -> 8 channels.
pub const CONV_MODULE: &str = r#"module @conv {
  func.func public @main(%x: tensor<1x8x8x4xf32>, %w: tensor<3x3x4x8xf32>) -> tensor<1x8x8x8xf32> {
    %0 = stablehlo.convolution(%x, %w) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x8x8x4xf32>, tensor<3x3x4x8xf32>) -> tensor<1x8x8x8xf32>
    return %0 : tensor<1x8x8x8xf32>
  }
}
"#;

/// Device `index` of the XLA CPU plugin as an [`OxiDevice`]; `None` when the
/// plugin is missing and `OXIDIFF_SKIP_PJRT_TESTS=1`.
pub fn xla_cpu(index: usize) -> Option<oxidiff_backend_tpu::OxiDevice> {
    plugin("xla:cpu")?;
    let text = format!("xla:cpu:{index}");
    match text.parse() {
        Ok(device) => Some(device),
        Err(e) => panic!("{text}: {e}"),
    }
}

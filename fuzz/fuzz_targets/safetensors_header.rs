//! A safetensors file from a stranger: our header check never panics, and whatever it accepts
//! the safetensors crate accepts too (it is the stricter gate in front of it), and loads.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oxidiff_models::safetensors_check::check_header;
use safetensors::SafeTensors;

fuzz_target!(|data: &[u8]| {
    if check_header(data).is_ok() {
        let parsed = SafeTensors::deserialize(data);
        assert!(parsed.is_ok(), "our check accepted what safetensors refuses: {parsed:?}");
        let st = parsed.unwrap();
        for (_, view) in st.tensors() {
            std::hint::black_box(view.data().len());
        }
    }
});

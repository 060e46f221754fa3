#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lserve_fuzz::harness::calibration::run(data));

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lserve_fuzz::harness::cache_manager::run(data));

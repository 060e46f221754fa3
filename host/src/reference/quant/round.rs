//! Directed rounding to bf16: the minimum of a group rounds down and its scale up, so that the
//! codes' range `[m, m + levels · s]` holds every value of the group.

use half::bf16;

/// The next bf16 above `b` (`b` finite or `-inf`).
pub(super) fn next_up(b: bf16) -> bf16 {
    let bits = b.to_bits();
    match bits {
        0x0000 | 0x8000 => bf16::from_bits(0x0001),
        _ if bits & 0x8000 == 0 => bf16::from_bits(bits + 1),
        _ => bf16::from_bits(bits - 1),
    }
}

/// The next bf16 below `b` (`b` finite or `+inf`).
pub(super) fn next_down(b: bf16) -> bf16 {
    let bits = b.to_bits();
    match bits {
        0x0000 | 0x8000 => bf16::from_bits(0x8001),
        _ if bits & 0x8000 == 0 => bf16::from_bits(bits - 1),
        _ => bf16::from_bits(bits + 1),
    }
}

/// The largest bf16 not above `x` (`x` finite; `-inf` below bf16's range).
pub(super) fn down(x: f64) -> bf16 {
    let b = bf16::from_f64(x);
    if b.to_f64() > x {
        next_down(b)
    } else {
        b
    }
}

/// The smallest bf16 not below `x` (`x` finite; `+inf` above bf16's range).
pub(super) fn up(x: f64) -> bf16 {
    let b = bf16::from_f64(x);
    if b.to_f64() < x {
        next_up(b)
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directed_rounding_brackets_the_value() {
        for x in [
            0.0,
            -0.0,
            1.0,
            -1.0,
            1.0 + 1e-3,
            -1.0 - 1e-3,
            1e-40,
            -1e-40,
            3.0e38,
            -3.0e38,
            0.1,
        ] {
            let (lo, hi) = (down(x).to_f64(), up(x).to_f64());
            assert!(lo <= x && x <= hi, "{x}: [{lo}, {hi}]");
            // Adjacent or equal: nothing representable strictly between.
            assert!(next_up(down(x)).to_f64() >= x, "{x}");
            assert!(next_down(up(x)).to_f64() <= x, "{x}");
        }
        assert_eq!(down(1.0), bf16::ONE);
        assert_eq!(up(1.0), bf16::ONE);
        assert!(up(1e39).is_infinite() && down(-1e39).is_infinite());
    }
}

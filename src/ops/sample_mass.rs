//! Top-p's probability mass as exact integers: the one definition that the
//! host reference (src/ops/sample.rs) and the device sampler
//! (kernels/layer_ops.cu, `sample_rows_f32`) both compute bit for bit.
//!
//! A kept token of scaled logit `s <= 0` (its logit minus the row's
//! maximum, over the temperature) weighs `q(s) = round(e(s) * 2^40)`
//! quanta, where `e(s)` approximates `exp(s)` in f32 (a few units in the
//! last place) by a fixed sequence of rounded f32 operations: a Cody-Waite
//! reduction by ln 2 and a degree-7 Taylor polynomial, no fused
//! multiply-add. Every operation is an IEEE-754 f32 multiply or add, so the
//! host and the device round identically; the sums of quanta are integers,
//! so their order does not matter. Tokens below `MASS_ZERO_BELOW` weigh 0
//! (`exp(-30) * 2^40 < 0.5`); the most likely token weighs `2^40`.
//!
//! build.rs includes this file and writes its constants into the kernels'
//! contract header, so the two sides cannot disagree.

/// Fraction bits of a quantum: a token of probability `p` relative to the
/// most likely one weighs `p * 2^MASS_FRACTION_BITS`.
pub(crate) const MASS_FRACTION_BITS: u32 = 40;

/// Scaled logits below this weigh 0 quanta.
pub(crate) const MASS_ZERO_BELOW: f32 = -30.0;

/// The largest vocabulary whose total mass fits a u64 (`vocab * 2^40`).
pub(crate) const MASS_MAX_VOCAB: usize = 1 << 23;

/// `log2(e)`, rounded to f32.
pub(crate) const MASS_LOG2_E: f32 = std::f32::consts::LOG2_E;

/// The high part of ln 2 (`0x3f317200`: 15 significant bits, so that
/// `k * MASS_LN2_HI` is exact for the `|k| <= 43` used here).
pub(crate) const MASS_LN2_HI: f32 = 0.693_145_75;

/// `ln 2 - MASS_LN2_HI`, rounded to f32.
pub(crate) const MASS_LN2_LO: f32 = 1.428_606_8e-6;

/// Taylor coefficients of `exp(r)`, `1 / j!` for `j = 0..=7`, rounded to f32.
pub(crate) const MASS_EXP_TAYLOR: [f32; 8] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
];

/// The quanta of a kept token of scaled logit `s` (`s <= 0`).
pub(crate) fn mass_quanta(s: f32) -> u64 {
    // A NaN weighs 0 too (callers never pass one), as on the device.
    if s.is_nan() || s < MASS_ZERO_BELOW {
        return 0;
    }
    let k = round_ties_even_f32(s * MASS_LOG2_E);
    let r = s - k * MASS_LN2_HI;
    let r = r - k * MASS_LN2_LO;
    let mut p = MASS_EXP_TAYLOR[7];
    for &c in MASS_EXP_TAYLOR[..7].iter().rev() {
        p = p * r + c;
    }
    // -43 <= k <= 0 here: 2^k is a normal f32 and the product is exact.
    let e = p * f32::from_bits(((127 + k as i32) as u32) << 23);
    round_ties_even_f64(e as f64 * (1u64 << MASS_FRACTION_BITS) as f64) as u64
}

/// `x` rounded to an integer, ties to even, for `|x| < 2^22`: adding and
/// subtracting `1.5 * 2^23` rounds in the addition, as IEEE-754 does, to
/// the same value as the device's `rintf`. (`f32::round_ties_even` is a
/// library call on baseline x86-64, in the host sampler's inner loop.)
fn round_ties_even_f32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

/// `x` rounded to an integer, ties to even, for `0 <= x < 2^52` (as the
/// device's `rint`), the same way.
fn round_ties_even_f64(x: f64) -> f64 {
    const MAGIC: f64 = 4_503_599_627_370_496.0; // 2^52
    (x + MAGIC) - MAGIC
}

/// The mass top-p must reach, `ceil(top_p * total)`, exactly: `top_p` is
/// `m / 2^sh` for its f32 significand `m`, and the product is taken in 128
/// bits.
pub(crate) fn mass_target(top_p: f32, total: u64) -> u64 {
    let bits = top_p.to_bits();
    let (exp, frac) = ((bits >> 23) & 0xff, bits & 0x7f_ffff);
    let (m, sh) = if exp == 0 {
        (frac, 149)
    } else {
        (frac | 0x80_0000, 150 - exp)
    };
    let prod = m as u128 * total as u128;
    if sh >= 128 {
        return u64::from(prod > 0);
    }
    // prod < 2^88 and 2^sh <= 2^127: the sum does not overflow.
    ((prod + (1u128 << sh) - 1) >> sh) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quanta_follow_exp_within_a_few_ulps() {
        assert_eq!(mass_quanta(0.0), 1 << MASS_FRACTION_BITS);
        assert_eq!(mass_quanta(-0.0), 1 << MASS_FRACTION_BITS);
        assert_eq!(mass_quanta(-30.5), 0);
        assert_eq!(mass_quanta(f32::NEG_INFINITY), 0);
        let mut s = 0.0f32;
        while s > -29.0 {
            let want = (s as f64).exp() * (1u64 << MASS_FRACTION_BITS) as f64;
            let got = mass_quanta(s) as f64;
            // A few f32 ulps (2^-24 each), plus the quantum's rounding.
            assert!(
                (got - want).abs() <= 4e-7 * want + 0.5,
                "s {s}: {got} quanta, exp gives {want}"
            );
            s -= 0.013_7;
        }
    }

    #[test]
    fn magic_rounding_is_ties_to_even() {
        for x in [
            -43.5f32, -42.5, -2.5, -1.5, -0.5, -0.4999, 0.0, 0.5, 1.5, -12.25, -7.75,
        ] {
            assert_eq!(round_ties_even_f32(x), x.round_ties_even(), "{x}");
        }
        for x in [
            0.0f64,
            0.5,
            1.5,
            2.5,
            1e12 + 0.5,
            1e12 + 1.5,
            1_099_511_627_776.49,
        ] {
            assert_eq!(round_ties_even_f64(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn ln2_is_split_as_documented() {
        assert_eq!(MASS_LN2_HI.to_bits(), 0x3f31_7200);
        let lo = std::f64::consts::LN_2 - MASS_LN2_HI as f64;
        assert_eq!(MASS_LN2_LO, lo as f32);
    }

    #[test]
    fn targets_are_exact_ceilings() {
        let total = (1u64 << 40) * 3 + 7;
        assert_eq!(mass_target(1.0, total), total);
        assert_eq!(mass_target(0.5, total), total.div_ceil(2));
        assert_eq!(mass_target(0.25, 8), 2);
        assert_eq!(mass_target(0.25, 9), 3);
        let p = 0.95f32;
        let exact = (p as f64) * 1e6;
        assert_eq!(mass_target(p, 1_000_000), exact.ceil() as u64);
        assert_eq!(mass_target(f32::from_bits(1), 5), 1);
        assert_eq!(mass_target(1e-30, 1 << 63), 1);
    }
}

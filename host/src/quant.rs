//! Quantized KV formats: what a cache row of one token and KV head holds when K and V are stored
//! as integer codes rather than bf16/f16, and the 8-bit form of the key statistics.
//!
//! **Codes.** A row of `D` channels is cut into groups of [`IntFormat::group_channels`]
//! consecutive channels (the whole row for [`QuantGroup::TokenHead`]). Each group has a scale
//! `s` and a minimum `m`, both bf16, and each channel an unsigned code `c` of
//! [`CodeBits::bits`] bits; the channel's value is `c · s + m` (asymmetric, one `fma` in f32).
//! The CPU reference of quantizing and dequantizing is
//! [`reference::quant`](crate::reference::quant); its rounding rules (the minimum rounded down,
//! the scale up, codes to nearest even) put every element within `s / 2` of its value.
//!
//! **Row layout** (one token, one KV head), in this order: the codes, `D` bytes for INT8,
//! `D / 2` for INT4 (channel `2i` in the low nibble of byte `i`, `2i + 1` in the high nibble);
//! then per group the pair `(s, m)` as two bf16 (4 bytes). [`IntFormat::row_bytes`] is the sum;
//! at `D = 128` a token-head row is 132 bytes in INT8 (bf16: 256) and 68 in INT4.
//!
//! **8-bit key statistics.** The `kmin`/`kmax` vectors of a logical page are stored as 8-bit
//! codes with one `(s, m)` pair per page and group of [`StatsGroup`] channels, `kmax` rounded up
//! and `kmin` rounded down, so the page score computed from them is still an upper bound of
//! every key's `q · k` ([`reference::quant::quantize_key_stats`](crate::reference::quant::quantize_key_stats)).
//!
//! The GPU kernels read and write bf16/f16 caches only; these formats are the specification the
//! quantized kernels are built to (`docs/QUANTIZATION.md`: the layout and the error and
//! selection measurements behind the choices).
//!
//! ```
//! use lserve::dtype::DType;
//! use lserve::quant::{CodeBits, IntFormat, KvFormat, QuantGroup};
//! let int8 = IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead);
//! assert_eq!(int8.row_bytes(128)?, 132);
//! let int4_g32 = IntFormat::new(CodeBits::Int4, QuantGroup::Channels(32));
//! assert_eq!(int4_g32.row_bytes(128)?, 64 + 4 * 4);
//! assert_eq!(KvFormat::Float(DType::BF16).row_bytes(128)?, 256);
//! // A group must divide the head dimension.
//! assert!(IntFormat::new(CodeBits::Int8, QuantGroup::Channels(48)).row_bytes(128).is_err());
//! # Ok::<(), lserve::LserveError>(())
//! ```

use core::fmt;

use crate::dtype::DType;
use crate::error::{LserveError, Result};

/// Bytes of one group's `(scale, minimum)` pair: two bf16.
pub const GROUP_PARAM_BYTES: usize = 4;

/// The width of an integer code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodeBits {
    /// 8-bit codes, 0..=255.
    Int8,
    /// 4-bit codes, 0..=15, two per byte.
    Int4,
}

impl CodeBits {
    /// Bits per code.
    pub const fn bits(self) -> u32 {
        match self {
            CodeBits::Int8 => 8,
            CodeBits::Int4 => 4,
        }
    }

    /// The largest code (`2^bits - 1`): a group's range is `levels() · s`.
    pub const fn levels(self) -> u32 {
        (1 << self.bits()) - 1
    }
}

/// Which channels of a row share one scale and minimum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantGroup {
    /// One pair per token and KV head (the whole row).
    TokenHead,
    /// One pair per this many consecutive channels (a positive multiple of 8 dividing `D`).
    Channels(usize),
}

/// An integer KV format: code width and grouping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IntFormat {
    /// Code width.
    pub bits: CodeBits,
    /// Channels per scale.
    pub group: QuantGroup,
}

impl IntFormat {
    /// The format of `bits`-bit codes grouped by `group` (checked against a head dimension where
    /// one is given: [`IntFormat::group_channels`], [`IntFormat::row_bytes`]).
    pub const fn new(bits: CodeBits, group: QuantGroup) -> Self {
        Self { bits, group }
    }

    /// Channels per group for head dimension `head_dim`.
    ///
    /// Errors: `InvalidArgument` unless `head_dim` is a positive multiple of 8 and the group a
    /// positive multiple of 8 dividing it (16-byte rows of codes, whole bytes of INT4 codes).
    pub fn group_channels(&self, head_dim: usize) -> Result<usize> {
        if head_dim == 0 || head_dim % 8 != 0 {
            return Err(LserveError::InvalidArgument {
                what: "head_dim",
                reason: format!("{head_dim} is not a positive multiple of 8"),
            });
        }
        let channels = match self.group {
            QuantGroup::TokenHead => head_dim,
            QuantGroup::Channels(c) => c,
        };
        if channels == 0 || channels % 8 != 0 || head_dim % channels != 0 {
            return Err(LserveError::InvalidArgument {
                what: "group",
                reason: format!(
                    "{channels} channels per group: must be a positive multiple of 8 dividing \
                     head_dim {head_dim}"
                ),
            });
        }
        Ok(channels)
    }

    /// Groups per row of `head_dim` channels.
    ///
    /// Errors: as [`IntFormat::group_channels`].
    pub fn groups(&self, head_dim: usize) -> Result<usize> {
        Ok(head_dim / self.group_channels(head_dim)?)
    }

    /// Bytes of the codes of one row.
    ///
    /// Errors: as [`IntFormat::group_channels`].
    pub fn code_bytes(&self, head_dim: usize) -> Result<usize> {
        self.group_channels(head_dim)?;
        Ok(head_dim * self.bits.bits() as usize / 8)
    }

    /// Bytes of one row: codes, then a `(scale, minimum)` pair per group.
    ///
    /// Errors: as [`IntFormat::group_channels`].
    pub fn row_bytes(&self, head_dim: usize) -> Result<usize> {
        Ok(self.code_bytes(head_dim)? + GROUP_PARAM_BYTES * self.groups(head_dim)?)
    }
}

impl fmt::Display for IntFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = self.bits.bits();
        match self.group {
            QuantGroup::TokenHead => write!(f, "int{bits} per token-head"),
            QuantGroup::Channels(c) => write!(f, "int{bits} per {c} channels"),
        }
    }
}

/// The element format of a KV cache: 16-bit floats or integer codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// bf16 or f16 elements, as the kernels read and write today.
    Float(DType),
    /// Integer codes with a scale and minimum per group.
    Int(IntFormat),
}

impl KvFormat {
    /// Bytes of one row (one token, one KV head) of `head_dim` channels.
    ///
    /// Errors: as [`IntFormat::group_channels`] for integer formats; `InvalidArgument` for
    /// `head_dim == 0`.
    pub fn row_bytes(&self, head_dim: usize) -> Result<usize> {
        match self {
            KvFormat::Float(dtype) if head_dim > 0 => Ok(head_dim * dtype.size_bytes()),
            KvFormat::Float(_) => Err(LserveError::InvalidArgument {
                what: "head_dim",
                reason: "must be positive".into(),
            }),
            KvFormat::Int(format) => format.row_bytes(head_dim),
        }
    }
}

/// The key statistics page selection scores from
/// ([`SparsityConfig::stats_format`](crate::config::SparsityConfig::stats_format)).
///
/// With [`Int8`](StatsFormat::Int8) a cache keeps beside its 16-bit `kmin`/`kmax` (which the
/// append and pooling maintain exactly) their 8-bit codes
/// ([`quantize_key_stats`](crate::reference::quant::quantize_key_stats)), recoded whenever a
/// logical page's bounds change, and the selector reads only the codes: about half the bytes per
/// selection. The bound property holds with either.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::quant::{StatsFormat, StatsGroup};
/// let c = SparsityConfig { stats_format: StatsFormat::Int8(StatsGroup::Channels(32)), ..Default::default() };
/// assert!(c.validate().is_ok());
/// assert_eq!(SparsityConfig::default().stats_format, StatsFormat::Half);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StatsFormat {
    /// `kmin`/`kmax` in the cache's 16-bit element type: `4 D` bytes per logical page and head.
    #[default]
    Half,
    /// 8-bit codes with a scale and minimum per group of channels ([`StatsGroup::page_bytes`]).
    /// The GPU kernels keep [`StatsGroup::Channels`]`(32)` (`2 D + D / 8` bytes); the CPU
    /// reference any group.
    Int8(StatsGroup),
}

impl StatsFormat {
    /// The 8-bit format the GPU kernels keep (`lserve_abi::buffers::StatCodesPtrs`).
    pub const DEVICE_INT8: StatsFormat = StatsFormat::Int8(StatsGroup::Channels(32));

    /// Errors: `InvalidArgument` for an 8-bit group that `head_dim` does not allow.
    pub fn check(&self, head_dim: usize) -> Result<()> {
        match self {
            StatsFormat::Half => Ok(()),
            StatsFormat::Int8(group) => group.group_channels(head_dim).map(|_| ()),
        }
    }
}

/// Which channels of a logical page's 8-bit key statistics share one scale and minimum (over
/// both `kmin` and `kmax` of those channels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatsGroup {
    /// One pair per logical page and KV head.
    Page,
    /// One pair per this many consecutive channels (a positive multiple of 8 dividing `D`).
    Channels(usize),
}

impl StatsGroup {
    /// Channels per group for head dimension `head_dim`.
    ///
    /// Errors: `InvalidArgument` as [`IntFormat::group_channels`].
    pub fn group_channels(&self, head_dim: usize) -> Result<usize> {
        let group = match *self {
            StatsGroup::Page => QuantGroup::TokenHead,
            StatsGroup::Channels(c) => QuantGroup::Channels(c),
        };
        IntFormat::new(CodeBits::Int8, group).group_channels(head_dim)
    }

    /// Bytes of one logical page's statistics (one KV head): `2 D` codes and a pair per group;
    /// bf16 statistics take `4 D`.
    ///
    /// Errors: as [`StatsGroup::group_channels`].
    pub fn page_bytes(&self, head_dim: usize) -> Result<usize> {
        let groups = head_dim / self.group_channels(head_dim)?;
        Ok(2 * head_dim + GROUP_PARAM_BYTES * groups)
    }
}

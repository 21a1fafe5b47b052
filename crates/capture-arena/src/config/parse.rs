//! Values of environment variables: seconds, sizes, flags.

use std::time::Duration;

/// Parses a number of seconds (`30`, `0.5`).
pub(crate) fn parse_seconds(v: &str) -> Result<Duration, String> {
    v.trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{v:?} is not a number of seconds >= 0"))
}

/// Parses `8GiB`, `512 MiB`, `4096`, `1.5GiB` (binary suffixes, case-insensitive `B` optional
/// on `K`/`M`/`G`/`T` + `i`). Decimal `GB` is refused to avoid a silent 7% difference.
pub fn parse_bytes(v: &str) -> Result<u64, String> {
    let s = v.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "ki" | "k" => 1 << 10,
        "mib" | "mi" | "m" => 1 << 20,
        "gib" | "gi" | "g" => 1 << 30,
        "tib" | "ti" | "t" => 1 << 40,
        _ => {
            return Err(format!(
                "{v:?}: unknown unit {unit:?}; use plain bytes or KiB, MiB, GiB, TiB"
            ))
        }
    };
    let bad = || format!("{v:?} is not a size (plain bytes, or a number with KiB, MiB, GiB, TiB)");
    if num.contains('.') {
        let f: f64 = num.parse().map_err(|_| bad())?;
        let b = f * mult as f64;
        if !(b.is_finite() && b >= 0.0 && b < u64::MAX as f64) {
            return Err(bad());
        }
        Ok(b as u64)
    } else {
        num.parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .ok_or_else(bad)
    }
}

/// An on/off setting: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off` (any case, spaces
/// around ignored); the reason otherwise.
pub fn parse_flag(v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("{v:?} is not a flag (1 or 0)")),
    }
}

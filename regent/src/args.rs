//! Command-line values shared by several subcommands.

use std::time::Duration;

/// Parses a duration such as `1h`, `30m`, `90s`, `500ms` or `1h30m`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err("an empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{text:?}: expected a number"));
        }
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|e| format!("{text:?}: {e}"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let part = match unit {
            "h" => n.checked_mul(3600).map(Duration::from_secs),
            "m" | "min" => n.checked_mul(60).map(Duration::from_secs),
            "s" | "" => Some(Duration::from_secs(n)),
            "ms" => Some(Duration::from_millis(n)),
            other => return Err(format!("{text:?}: unknown unit {other:?} (h, m, s, ms)")),
        };
        total = part
            .and_then(|p| total.checked_add(p))
            .ok_or_else(|| format!("{text:?}: too long"))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("30m").unwrap(), Duration::from_secs(1800));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("5 days").is_err());
        assert!(parse_duration("h").is_err());
        assert!(parse_duration("99999999999999999999h").is_err());
        assert!(parse_duration("9999999999999999999h").is_err());
        assert!(parse_duration("18446744073709551615s1s").is_err());
    }
}

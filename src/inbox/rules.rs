//! The inbox's rules, apart from its storage: the checks of the names and
//! event keys a call is given. Both backends' handles call them before
//! anything is written.

use super::{MAX_EVENT_KEY_LEN, MAX_INBOX_NAME_LEN};
use crate::error::{Error, Result, check_len};

pub(crate) fn check_event_key(key: &str) -> Result<()> {
    check_len("event key", key, MAX_EVENT_KEY_LEN)
}

/// Checks many event keys (`claim_many`'s) before any is written, and
/// copies them: one bad key fails them all.
pub(crate) fn check_event_keys<I, K>(event_keys: I) -> Result<Vec<String>>
where
    I: IntoIterator<Item = K>,
    K: AsRef<str>,
{
    event_keys
        .into_iter()
        .map(|k| {
            let k = k.as_ref();
            check_event_key(k).map(|()| k.to_owned())
        })
        .collect()
}

pub(crate) fn check_inbox_name(name: &str) -> Result<()> {
    check_len("inbox name", name, MAX_INBOX_NAME_LEN)?;
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(Error::invalid(
            "inbox name",
            format!("{c:?} is not allowed; use ASCII letters, digits, '_', '-' and '.'"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for bad in ["", "has space", "slash/", "nul\0", "ü"] {
            assert!(
                matches!(check_inbox_name(bad), Err(Error::InvalidInput { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check_inbox_name(&"a".repeat(65)),
            Err(Error::TooLarge { .. })
        ));
        for good in ["webhooks", "payments.v2", "a-b_c", &"a".repeat(64)] {
            assert!(check_inbox_name(good).is_ok(), "{good:?}");
        }
    }
}

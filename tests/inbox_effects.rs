//! `claim_with` and `claim_in`: the claim and the effect commit together.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::redb::{ReadableTable, TableDefinition};
use idemstore::{Claim, Error, Result, Store};

const LEDGER: TableDefinition<&str, i64> = TableDefinition::new("app.ledger");

fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
}

fn credit(tx: &idemstore::redb::WriteTransaction, account: &str, amount: i64) -> Result<i64> {
    let mut ledger = tx.open_table(LEDGER)?;
    let old = ledger.get(account)?.map_or(0, |v| v.value());
    ledger.insert(account, old + amount)?;
    Ok(old + amount)
}

fn balance(store: &Store, account: &str) -> Result<i64> {
    store.read(|tx| match tx.open_table(LEDGER) {
        Ok(t) => Ok(t.get(account)?.map_or(0, |v| v.value())),
        Err(idemstore::redb::TableError::TableDoesNotExist(_)) => Ok(0),
        Err(e) => Err(e.into()),
    })
}

#[test]
fn an_effect_runs_once_and_commits_with_its_claim() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("payments")?;
    let runs = Cell::new(0);
    for _ in 0..3 {
        let outcome = inbox.claim_with("evt-1", t(0), |tx| {
            runs.set(runs.get() + 1);
            credit(tx, "alice", 10)
        })?;
        if runs.get() == 1 && outcome.is_applied() {
            assert_eq!(outcome, Claim::Applied(10));
        } else {
            assert_eq!(outcome, Claim::Duplicate);
        }
    }
    assert_eq!(runs.get(), 1, "the effect ran once");
    assert_eq!(balance(&store, "alice")?, 10);
    assert!(inbox.seen("evt-1")?);
    Ok(())
}

#[test]
fn failing_effect_commits_neither_claim_nor_writes() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("payments")?;
    let r: Result<Claim<i64>> = inbox.claim_with("evt-1", t(0), |tx| {
        credit(tx, "alice", 10)?;
        Err(Error::InvalidInput {
            field: "amount",
            reason: "declined by the effect".into(),
        })
    });
    assert!(matches!(
        r,
        Err(Error::InvalidInput {
            field: "amount",
            ..
        })
    ));
    assert!(!inbox.seen("evt-1")?, "the key stays unclaimed");
    assert_eq!(
        balance(&store, "alice")?,
        0,
        "the effect's write was rolled back"
    );
    // The next delivery runs the effect again, and this time it sticks.
    let outcome = inbox.claim_with("evt-1", t(1), |tx| credit(tx, "alice", 10))?;
    assert_eq!(outcome, Claim::Applied(10));
    assert_eq!(balance(&store, "alice")?, 10);
    Ok(())
}

/// A caller error type of its own: effects may return any `E: From<Error>`.
#[derive(Debug)]
enum AppError {
    Store(Error),
    Rejected(&'static str),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Store(e)
    }
}

#[test]
fn effects_may_use_the_callers_error_type() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("orders")?;
    let r: Result<Claim<()>, AppError> =
        inbox.claim_with("o-1", t(0), |_| Err(AppError::Rejected("out of stock")));
    assert!(matches!(r, Err(AppError::Rejected("out of stock"))));
    let r: Result<Claim<()>, AppError> = inbox.claim_with("", t(0), |_| Ok(()));
    assert!(matches!(
        r,
        Err(AppError::Store(Error::InvalidInput { .. }))
    ));
    assert!(inbox.is_empty()?);
    Ok(())
}

#[test]
fn panicking_effect_leaves_the_key_unclaimed_and_the_file_clean() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.idem");
    {
        let store = Store::open(&path)?;
        let inbox = store.inbox("payments")?;
        let caught = catch_unwind(AssertUnwindSafe(|| {
            inbox.claim_with("evt-boom", t(0), |tx| -> Result<()> {
                credit(tx, "alice", 99)?;
                panic!("effect exploded");
            })
        }));
        let payload = caught.expect_err("the panic reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"effect exploded"));
        assert!(!inbox.seen("evt-boom")?);
        assert_eq!(balance(&store, "alice")?, 0);
        // The store keeps working after the panic.
        assert!(inbox.claim("evt-after", t(1))?);
    }
    // Reopen with redb directly and a repair callback: no repair is needed.
    let repaired = Rc::new(Cell::new(false));
    let flag = repaired.clone();
    let mut builder = idemstore::redb::Database::builder();
    builder.set_repair_callback(move |_| flag.set(true));
    let db = builder.open(&path).map_err(idemstore::redb::Error::from)?;
    assert!(!repaired.get(), "the file needed no repair after the panic");
    drop(db);
    let store = Store::open(&path)?;
    let inbox = store.inbox("payments")?;
    assert!(inbox.seen("evt-after")?);
    assert!(!inbox.seen("evt-boom")?);
    assert_eq!(balance(&store, "alice")?, 0);
    Ok(())
}

#[test]
fn claim_in_commits_or_rolls_back_with_the_callers_writes() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("events")?;
    let audit = store.inbox("audit")?;
    // Both inboxes and the caller's table in one commit.
    let applied = store.write(|tx| {
        let first = inbox.claim_in(tx, "e-1", t(0))?;
        if first {
            audit.claim_in(tx, "e-1", t(0))?;
            credit(tx, "bob", 5)?;
        }
        Ok::<_, Error>(first)
    })?;
    assert!(applied);
    assert!(audit.seen("e-1")?);
    assert_eq!(balance(&store, "bob")?, 5);

    // A write that fails after claiming rolls the claim back too.
    let r = store.write(|tx| {
        assert!(inbox.claim_in(tx, "e-2", t(1))?);
        credit(tx, "bob", 5)?;
        Err::<(), _>(Error::InvalidInput {
            field: "test",
            reason: "abort".into(),
        })
    });
    assert!(r.is_err());
    assert!(!inbox.seen("e-2")?);
    assert_eq!(balance(&store, "bob")?, 5);
    Ok(())
}

#[test]
fn a_plain_claim_inside_a_write_is_refused_not_deadlocked() -> Result<()> {
    let store = Store::in_memory()?;
    let inbox = store.inbox("events")?;
    // Inside a write closure, the non-`_in` calls refuse instead of deadlocking.
    let r = store.write(|_| inbox.claim("e-3", t(2)));
    assert!(matches!(r, Err(Error::Reentrant)));
    assert!(!inbox.seen("e-3")?);
    Ok(())
}

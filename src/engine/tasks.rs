//! Operations queued from async tasks (feature `tokio`): they join the
//! same batches as threads' operations, and the task is woken, not a
//! thread, when its batch is done.
//!
//! A task never leads a batch: leading runs redb and waits for the fsync,
//! which would hold the runtime's worker. When a task's operation would
//! lead (it found nobody leading, or the leader hands it the lead), the
//! engine's task leader, one thread per store started at the first such
//! operation, leads the batch in its place. So however many tasks wait on
//! a store, at most one thread is busy for them, and only while a batch
//! runs; a batch's threads and tasks share its fsync.
//!
//! # Invariants
//!
//! - Those of `batch`: a task's operation is an item of the queue like a
//!   thread's. Asked to lead ([`Queued::promote`]), it has the task leader
//!   lead for it; the leader's batch starts with the first queued item,
//!   which is that operation, so the queue is never left without a leader.
//! - Every lead asked of the task leader is run: a request sets a flag
//!   under its mutex, and the leader looks at the flag under that mutex
//!   before it waits. Requests never overlap (one leader at a time, and
//!   only the leader hands on the lead), so a flag is enough.
//! - A task's answer is sent on its one-shot channel once its batch is
//!   done; a task is never in a batch's wake tree (its wake-up is the
//!   channel's, which needs no system call on the leader's thread). If the
//!   task's future was dropped, the answer is dropped: the operation ran,
//!   and committed as its batch did.
//!
//! # Locks
//!
//! The task leader's flag mutex is a leaf, taken under `queue` when the
//! lead is handed to a task's operation.

use std::panic::resume_unwind;
use std::sync::{Arc, Weak};

use parking_lot::{Condvar, Mutex};
use redb::WriteTransaction;
use tokio::sync::oneshot;

use super::batch::{Needs, Queued, Run};
use super::inner::Inner;
use super::wake::{Notify, Reply, WakeTree};
use crate::error::{Error, Result};

/// A task's operation with its channel (`None`: nobody waits).
struct TaskOperation<T, F> {
    run: Run<T, F>,
    reply: Option<oneshot::Sender<Reply<T>>>,
    needs: Needs,
    leader: Arc<TaskLeader>,
}

impl<T, F> TaskOperation<T, F>
where
    F: Fn(&WriteTransaction) -> Result<T>,
{
    /// Sends the task its answer.
    fn send(&mut self, committed: Result<(), Error>) {
        let answer = self.run.answer(committed);
        if let Some(reply) = self.reply.take() {
            // A dropped future: nobody to tell.
            let _ = reply.send(answer);
        }
    }
}

impl<T, F> Queued for TaskOperation<T, F>
where
    T: Send + 'static,
    F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
{
    fn run(&mut self, tx: &WriteTransaction) -> bool {
        self.run.run(tx)
    }

    fn replay(&self, tx: &WriteTransaction) -> bool {
        self.run.replay(tx)
    }

    fn finish(&mut self, committed: Result<(), Error>) {
        self.send(committed);
    }

    fn finish_quietly(&mut self, committed: Result<(), Error>, _: Arc<WakeTree>, _: usize) {
        // Never in a wake tree (`wakes_itself`); answered at once if asked.
        self.send(committed);
    }

    fn caller(&self) -> Arc<dyn Notify> {
        Arc::new(NoThread)
    }

    fn promote(&self) {
        self.leader.request();
    }

    fn needs(&self) -> Needs {
        self.needs
    }

    fn wakes_itself(&self) -> bool {
        true
    }
}

/// A task's place in a wake tree it is never in: no thread to wake.
struct NoThread;

impl Notify for NoThread {
    fn notify(&self) {}
}

/// The thread that leads batches for tasks' operations.
pub(super) struct TaskLeader {
    asked: Mutex<Asked>,
    signal: Condvar,
}

#[derive(Default)]
struct Asked {
    lead: bool,
    stop: bool,
}

impl TaskLeader {
    /// Starts the task leader of `inner`, which it holds weakly: it stops
    /// when the engine's last handle is gone.
    fn start(inner: Weak<Inner>) -> Result<Arc<TaskLeader>> {
        let leader = Arc::new(TaskLeader {
            asked: Mutex::new(Asked::default()),
            signal: Condvar::new(),
        });
        let me = leader.clone();
        std::thread::Builder::new()
            .name("idemstore-task-leader".into())
            .spawn(move || me.run(&inner))
            .map_err(Error::Io)?;
        Ok(leader)
    }

    /// Asks the leader to lead the next batch.
    fn request(&self) {
        self.asked.lock().lead = true;
        self.signal.notify_one();
    }

    /// Stops the leader once it is idle.
    pub(super) fn stop(&self) {
        self.asked.lock().stop = true;
        self.signal.notify_one();
    }

    fn run(&self, inner: &Weak<Inner>) {
        loop {
            {
                let mut asked = self.asked.lock();
                while !asked.lead && !asked.stop {
                    self.signal.wait(&mut asked);
                }
                if !asked.lead {
                    return;
                }
                asked.lead = false;
            }
            let Some(inner) = inner.upgrade() else {
                return;
            };
            // Every caller of the batch is answered when `lead` returns;
            // what is left runs now, as a thread leader's runs once it has
            // its own answer.
            let after = inner.lead();
            inner.after_answers(after);
        }
    }
}

impl Inner {
    /// Queues `op` from a task and waits, without holding a thread, for its
    /// batch: as [`Inner::submit`], but a batch the operation would lead
    /// is led by the task leader.
    ///
    /// Nothing happens before the future is first polled. Dropped after
    /// that, the operation stays queued: it runs and commits with its
    /// batch, and its answer is dropped.
    pub(super) async fn submit_async<T, F>(self: &Arc<Self>, op: F, needs: Needs) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.queue_task(op, Some(reply), needs)?;
        match answer.await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => resume_unwind(panic),
            // The operation was dropped unanswered: only if the engine
            // itself went away with it.
            Err(_) => Err(Error::Panicked {
                during: "a batch",
                message: "the store closed before the operation was answered".to_owned(),
            }),
        }
    }

    /// Queues `op` to run in a coming batch, answering nobody: for the
    /// clean-up of a task's call dropped while its operation was queued
    /// (queued after that operation, it runs after it). A batch it would
    /// lead is led by the task leader; no thread waits.
    pub(super) fn submit_detached<F>(self: &Arc<Self>, op: F) -> Result<()>
    where
        F: Fn(&WriteTransaction) -> Result<()> + Send + 'static,
    {
        self.queue_task(op, None, Needs::Default)
    }

    /// Queues a task's operation `op` answering `reply`; if nobody leads,
    /// asks the task leader to.
    fn queue_task<T, F>(
        self: &Arc<Self>,
        op: F,
        reply: Option<oneshot::Sender<Reply<T>>>,
        needs: Needs,
    ) -> Result<()>
    where
        T: Send + 'static,
        F: Fn(&WriteTransaction) -> Result<T> + Send + 'static,
    {
        let leader = self.task_leader()?;
        let item = TaskOperation {
            run: Run::new(op),
            reply,
            needs,
            leader: leader.clone(),
        };
        let lead_now = {
            let mut q = self.queue.lock();
            q.queued.push(Box::new(item));
            !std::mem::replace(&mut q.leading, true)
        };
        if lead_now {
            leader.request();
        }
        Ok(())
    }

    /// The task leader, started on first use.
    fn task_leader(self: &Arc<Self>) -> Result<Arc<TaskLeader>> {
        let mut slot = self.task_leader.lock();
        if let Some(leader) = &*slot {
            return Ok(leader.clone());
        }
        let leader = TaskLeader::start(Arc::downgrade(self))?;
        *slot = Some(leader.clone());
        Ok(leader)
    }

    /// [`Inner::wait_durable`] for a task: once commit `seq` is durable,
    /// queuing an empty durable operation if it is not yet.
    pub(super) async fn wait_durable_async(self: &Arc<Self>, seq: u64) -> Result<()> {
        loop {
            {
                let s = self.sync.lock();
                if s.durable >= seq {
                    return Ok(());
                }
                if let Some(refusal) = s.refusal() {
                    return Err(refusal);
                }
            }
            // A durable commit persists every commit before it.
            self.submit_async(|_| Ok(()), Needs::Durable).await?;
        }
    }

    /// [`Inner::commit_pending`] for a task.
    pub(super) async fn commit_pending_async(self: &Arc<Self>) -> Result<()> {
        if self.pending.load(std::sync::atomic::Ordering::SeqCst) {
            self.submit_async(|_| Ok(()), Needs::Commit).await?;
        }
        Ok(())
    }
}

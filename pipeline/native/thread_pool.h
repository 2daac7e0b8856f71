/* Threads that outlive the batches they work on, for decode_engine.c: a batch is handed to them
 * and waited for, rather than each batch starting threads and each thread its own decoder and
 * buffers. The caller can then prepare the next batch, or finish the last one, while they work.
 *
 * A task is a function that takes work from its argument until none is left to take (an atomic
 * counter), called by up to `threads` pool threads at once. Each thread passes the function its
 * own slot (`state`), kept from task to task: what the function keeps there (a decoder, buffers)
 * is made once per thread. A free thread joins the first task started that has room for it, so
 * with as many threads as a batch asks for, they move on to the next batch as the last samples
 * of the one before run out.
 *
 * A forked child has none of its parent's threads: it starts its own (pthread_atfork).
 * Header-only, as jpeg_restarts.h.
 */
#ifndef THREAD_POOL_H
#define THREAD_POOL_H

#include <pthread.h>

typedef struct pool_task {
    void (*work)(void *argument, void **state);   /* returns once no work is left to take */
    void *argument;
    int threads;                                   /* the most pool threads on it at once (at least 1) */
    int working, exhausted, finished;              /* the pool's, under its lock */
    struct pool_task *next;                        /* in the queue of tasks that may still be joined */
} pool_task;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t queued, finished;
    pool_task *queue;
    int threads;                                   /* started in this process */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0};

static pthread_once_t pool_fork_handler = PTHREAD_ONCE_INIT;

static void pool_after_fork(void) {                /* the child: no threads, a lock nobody holds */
    pool.lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    pool.queued = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    pool.finished = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    pool.queue = NULL;
    pool.threads = 0;
}

static void pool_register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void *pool_thread(void *unused) {
    (void)unused;
    void *state = NULL;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        pool_task *task = pool.queue;
        while (task && task->working >= task->threads) task = task->next;
        if (!task) {
            pthread_cond_wait(&pool.queued, &pool.lock);
            continue;
        }
        task->working++;
        pthread_mutex_unlock(&pool.lock);
        task->work(task->argument, &state);
        pthread_mutex_lock(&pool.lock);
        task->working--;
        if (!task->exhausted) {                    /* none joins it any more */
            task->exhausted = 1;
            pool_task **link = &pool.queue;
            while (*link != task) link = &(*link)->next;
            *link = task->next;
        }
        if (!task->working) {
            task->finished = 1;
            pthread_cond_broadcast(&pool.finished);
        }
    }
    return NULL;
}

/* Queues `task` (which must outlive pool_finish) for the pool's threads, started up to
 * task->threads. Where not one thread could be started, works it in the caller. */
static void pool_start(pool_task *task) {
    pthread_once(&pool_fork_handler, pool_register_fork_handler);
    task->working = task->exhausted = task->finished = 0;
    task->next = NULL;
    if (task->threads < 1) task->threads = 1;
    pthread_mutex_lock(&pool.lock);
    while (pool.threads < task->threads) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, pool_thread, NULL);
        pthread_attr_destroy(&attributes);
        if (failed) break;
        pool.threads++;
    }
    if (!pool.threads) {
        pthread_mutex_unlock(&pool.lock);
        static __thread void *caller_state;
        task->work(task->argument, &caller_state);
        task->exhausted = task->finished = 1;
        return;
    }
    pool_task **link = &pool.queue;
    while (*link) link = &(*link)->next;
    *link = task;
    pthread_cond_broadcast(&pool.queued);
    pthread_mutex_unlock(&pool.lock);
}

/* Waits until every thread on `task` has left it. */
static void pool_finish(pool_task *task) {
    pthread_mutex_lock(&pool.lock);
    while (!task->finished) pthread_cond_wait(&pool.finished, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
}

#endif

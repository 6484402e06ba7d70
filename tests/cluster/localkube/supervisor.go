package main

import (
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// supervisor owns the component child processes. Each child logs to <logDir>/<name>.log, dies
// with the supervisor (Pdeathsig) and stays in the supervisor's process group, so a caller that
// signals the group stops everything at once.
type supervisor struct {
	mu       sync.Mutex
	procs    []*child
	stopping bool
	// exited receives the name of a child that exited while the supervisor was not stopping.
	exited chan string
}

type child struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func (s *supervisor) start(logDir, name, binary string, args ...string) error {
	_, err := s.startCmd(logDir, name, exec.Command(binary, args...))
	return err
}

// startCmd starts a prepared command (its Env and Dir may be set) as a supervised child and
// returns its pid.
func (s *supervisor) startCmd(logDir, name string, cmd *exec.Cmd) (int, error) {
	logFile, err := os.Create(filepath.Join(logDir, name+".log"))
	if err != nil {
		return 0, err
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return 0, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{})}
	s.mu.Lock()
	s.procs = append(s.procs, c)
	s.mu.Unlock()
	log.Printf("started %s (pid %d)", name, cmd.Process.Pid)
	go func() {
		err := cmd.Wait()
		_ = logFile.Close()
		close(c.done)
		s.mu.Lock()
		stopping := s.stopping
		s.mu.Unlock()
		if !stopping {
			log.Printf("%s exited: %v", name, err)
			s.exited <- name
		}
	}()
	return cmd.Process.Pid, nil
}

// stopAll sends SIGTERM to the children in reverse start order, so clients stop before the
// apiserver they talk to, and SIGKILLs whatever is still running after grace.
func (s *supervisor) stopAll(grace time.Duration) {
	s.mu.Lock()
	s.stopping = true
	procs := append([]*child(nil), s.procs...)
	s.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		_ = procs[i].cmd.Process.Signal(syscall.SIGTERM)
	}
	deadline := time.After(grace)
	for i := len(procs) - 1; i >= 0; i-- {
		select {
		case <-procs[i].done:
		case <-deadline:
			for _, c := range procs {
				_ = c.cmd.Process.Kill()
			}
			for _, c := range procs {
				<-c.done
			}
			return
		}
	}
}
